# The block protocol codec and the server's access rules (blockdev/src/proto).
ibtrs_test(unit_ibnbd_proto SOURCES ibnbd_proto_test.cc access_test.cc GTEST_MAIN LABELS unit)
target_link_libraries(unit_ibnbd_proto PRIVATE ibnbd_proto_internal)
