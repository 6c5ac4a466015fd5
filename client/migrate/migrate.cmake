# client/migrate: migration images on IBNBD volumes (docs/migration-image.md) — the on-volume
# format, the image store / writer / reader, and the Volume over a mapped device.

# QEMU's own RDMA migration protocol, the transport-free part: the control channel's wire format
# and the RAM-section parser / rewriters of migration streams. A library of its own so the fuzz
# targets and tests link it without the client library.
add_library(ibnbd_migrate_qemu STATIC
  ${CMAKE_CURRENT_LIST_DIR}/src/qemu_rdma_wire.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/qemu_ram_stream.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/qemu_rdma_ram.cc
)
target_include_directories(ibnbd_migrate_qemu PUBLIC ${CMAKE_CURRENT_LIST_DIR}/src)
target_link_libraries(ibnbd_migrate_qemu PUBLIC ibtrs_wire_internal PRIVATE ibtrs_build_flags)
# The protocol over rdma-core (the agent's `rdma ADDR:PORT`, the hostile-peer test tool): only
# when libibverbs / librdmacm are there; the agent says so otherwise.
if(IBTRS_HAVE_RDMA)
  add_library(ibnbd_migrate_rdma STATIC ${CMAKE_CURRENT_LIST_DIR}/src/qemu_rdma_endpoint.cc)
  target_include_directories(ibnbd_migrate_rdma PUBLIC ${CMAKE_CURRENT_LIST_DIR}/src
    PRIVATE ${IBVERBS_INCLUDE} ${RDMACM_INCLUDE})
  target_link_libraries(ibnbd_migrate_rdma PUBLIC ibnbd_migrate_qemu ibtrs_internal ${IBVERBS_LIB} ${RDMACM_LIB}
    PRIVATE ibtrs_build_flags)
endif()
add_library(ibnbd_migrate STATIC
  ${CMAKE_CURRENT_LIST_DIR}/src/crc32c.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/image_format.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/image_store.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/qemu_stream.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/device_volume.cc
  ${CMAKE_CURRENT_LIST_DIR}/src/nbd_volume.cc
)
target_include_directories(ibnbd_migrate PUBLIC ${CMAKE_CURRENT_LIST_DIR}/include
  PRIVATE ${CMAKE_CURRENT_LIST_DIR}/src)
# ibnbd_nbd: ibnbd/nbd_proto.h, the NBD wire structs (nbd_volume.cc is an NBD client).
target_link_libraries(ibnbd_migrate PUBLIC ibnbd_client Threads::Threads
  PRIVATE ibnbd_nbd ibnbd_migrate_qemu ibtrs_internal ibtrs_build_flags)
# The on-volume structs, for the project's own tests.
add_library(ibnbd_migrate_internal INTERFACE)
target_include_directories(ibnbd_migrate_internal INTERFACE ${CMAKE_CURRENT_LIST_DIR}/src)
target_link_libraries(ibnbd_migrate_internal INTERFACE ibnbd_migrate ibtrs_internal)

# The migration agent (QEMU's exec: / unix: peer; `ibnbd migrate ...` runs it).
add_executable(ibnbd-migrate ${CMAKE_CURRENT_LIST_DIR}/agent/main.cc)
target_link_libraries(ibnbd-migrate PRIVATE ibnbd_migrate ibnbd_control ibtrs_internal ibtrs_build_flags)
if(IBTRS_HAVE_RDMA)
  target_link_libraries(ibnbd-migrate PRIVATE ibnbd_migrate_rdma)
  target_compile_definitions(ibnbd-migrate PRIVATE IBNBD_MIGRATE_RDMA=1)
endif()
set_target_properties(ibnbd-migrate PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/migrate)
ibtrs_not_under_tsan(ibnbd-migrate)
