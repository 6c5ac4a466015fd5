# The IBNBD block protocol: wire codec (src/proto/ibnbd_proto.*), the server's access rules
# (src/proto/access.*) and the vocabulary's text forms (src/types.cc).
add_library(ibnbd_proto STATIC
  src/types.cc
  src/proto/ibnbd_proto.cc
  src/proto/access.cc
)
target_include_directories(ibnbd_proto PUBLIC include PRIVATE src)
# The block protocol rides on IBTRS: its messages name the transport's IO directions.
target_link_libraries(ibnbd_proto PUBLIC ibnbd_types ibtrs_wire PRIVATE ibtrs_build_flags)

# The private headers, for the project's own tests and fuzzers.
add_library(ibnbd_proto_internal INTERFACE)
target_include_directories(ibnbd_proto_internal INTERFACE src)
target_link_libraries(ibnbd_proto_internal INTERFACE ibnbd_proto ibtrs_internal)
