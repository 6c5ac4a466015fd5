# ibnbd_backend: the server's storage backends (export resolution, opened devices, the io_uring
# IO engine). liburing stays private: the public header (ibnbd/backend.h) does not include it.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(LIBURING QUIET IMPORTED_TARGET liburing)
endif()
if(TARGET PkgConfig::LIBURING)
  set(IBNBD_URING PkgConfig::LIBURING)
else()
  find_library(URING_LIB uring)
  find_path(URING_INCLUDE liburing.h)
  if(NOT URING_LIB OR NOT URING_INCLUDE)
    message(FATAL_ERROR "liburing not found (Debian: apt-get install liburing-dev)")
  endif()
  add_library(ibnbd_uring INTERFACE)
  target_include_directories(ibnbd_uring SYSTEM INTERFACE ${URING_INCLUDE})
  target_link_libraries(ibnbd_uring INTERFACE ${URING_LIB})
  set(IBNBD_URING ibnbd_uring)
endif()

# RBD images (ibnbd/rbd.h) through librados + librbd (Debian's librbd-dev): IBNBD_RBD=AUTO builds
# them when the library is there, ON requires it, OFF leaves it out (rbd: names then get
# EOPNOTSUPP).
set(IBNBD_RBD AUTO CACHE STRING "RBD (Ceph) exports: AUTO, ON or OFF")
find_library(RBD_LIB rbd)
find_library(RADOS_LIB rados)
find_path(RBD_INCLUDE rbd/librbd.h)
set(IBNBD_HAVE_RBD OFF)
if(NOT IBNBD_RBD STREQUAL "OFF")
  if(RBD_LIB AND RADOS_LIB AND RBD_INCLUDE)
    set(IBNBD_HAVE_RBD ON)
  elseif(IBNBD_RBD STREQUAL "ON")
    message(FATAL_ERROR "IBNBD_RBD=ON but librbd/librados were not found (run scripts/setup.sh)")
  endif()
endif()
set(IBNBD_HAVE_RBD ${IBNBD_HAVE_RBD} PARENT_SCOPE)
message(STATUS "ibnbd: rbd backend ${IBNBD_HAVE_RBD}")

add_library(ibnbd_backend STATIC
  src/backend/sys.cc
  src/backend/export_path.cc
  src/backend/backend.cc
  src/backend/blocking_worker.cc
  src/backend/extents.cc
  src/backend/io_engine.cc
  src/backend/rbd.cc
)
target_include_directories(ibnbd_backend PRIVATE src)
target_link_libraries(ibnbd_backend
  PUBLIC ibnbd_types Threads::Threads
  PRIVATE ${IBNBD_URING} ibtrs_build_flags ibnbd_proto_internal)
if(IBNBD_HAVE_RBD)
  target_compile_definitions(ibnbd_backend PRIVATE IBNBD_HAVE_RBD)
  target_include_directories(ibnbd_backend SYSTEM PRIVATE ${RBD_INCLUDE})
  target_link_libraries(ibnbd_backend PRIVATE ${RBD_LIB} ${RADOS_LIB})
endif()

# The internal headers (slots, tags, sysfs limits) for the project's own tests.
add_library(ibnbd_backend_internal INTERFACE)
target_include_directories(ibnbd_backend_internal INTERFACE src)
target_link_libraries(ibnbd_backend_internal INTERFACE ibnbd_backend ${IBNBD_URING})
