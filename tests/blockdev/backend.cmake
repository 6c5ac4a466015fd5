# Tests of the storage backends (blockdev/backend.cmake). They move real bytes through io_uring
# on scratch files (tmpfs and an O_DIRECT filesystem found at run time) and, as root, on loop
# devices and a tiny tmpfs in a private mount namespace; what the host cannot offer is skipped
# with the reason.
ibtrs_test(unit_backend_export SOURCES backend_export_test.cc GTEST_MAIN LABELS unit)
ibtrs_test(unit_backend_io SOURCES backend_io_test.cc GTEST_MAIN LABELS unit)
ibtrs_test(unit_backend_bdev SOURCES backend_bdev_test.cc GTEST_MAIN LABELS unit)
# The engine's RBD path over a fake image completing from threads of its own (no cluster: every
# build, TSan's included, checks the completion hand-off).
ibtrs_test(unit_backend_rbd SOURCES backend_rbd_test.cc GTEST_MAIN LABELS unit)
foreach(t unit_backend_export unit_backend_io unit_backend_bdev unit_backend_rbd)
  target_link_libraries(${t} PRIVATE ibnbd_backend_internal)
endforeach()
target_link_libraries(unit_backend_io PRIVATE ibnbd_proto_internal)  # BLOCK_STATUS answers
