# `cmake --install`: the attnd and attnctl binaries, the C++ client library with its headers, a
# CMake package (find_package(attnd) -> attnd::client) and a pkg-config file (attnd-client).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS attnd attnctl RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# The data plane's client end for other languages (the Python client finds it on the library path).
install(TARGETS attnd_plane LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS attnd_client attnd_proto attnd_dtype attnd_block_hash attnd_transport_ucx
  EXPORT attndTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${CMAKE_INSTALL_INCLUDEDIR}/attnd)
# include/attnd/{client,common,v1}: a program includes <attnd/client/attnd_client.h> (or
# "client/attnd_client.h"); the headers find each other and the generated API through both roots.
set(ATTND_INCLUDE ${CMAKE_INSTALL_INCLUDEDIR}/attnd)
install(FILES client/attention_merge.h client/attnd_client.h client/context_parallel.h client/router.h
  client/sequence_import.h DESTINATION ${ATTND_INCLUDE}/client)
install(FILES common/block_hash.h common/dtype.h common/host_device.h
  DESTINATION ${ATTND_INCLUDE}/common)
install(FILES ${ATTND_GEN}/attnd/v1/attention.pb.h ${ATTND_GEN}/attnd/v1/attention.grpc.pb.h
  DESTINATION ${ATTND_INCLUDE}/v1)
install(FILES proto/attnd/v1/attention.proto DESTINATION ${CMAKE_INSTALL_DATADIR}/attnd/proto/attnd/v1)

set_target_properties(attnd_proto PROPERTIES EXPORT_NAME proto)
set_target_properties(attnd_dtype PROPERTIES EXPORT_NAME dtype)
set_target_properties(attnd_block_hash PROPERTIES EXPORT_NAME block_hash)
install(EXPORT attndTargets NAMESPACE attnd:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/attnd)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/attndConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/attndConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/attnd)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/attndConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/attndConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/attndConfigVersion.cmake DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/attnd)
# The .pc goes in LIBDIR/pkgconfig: its prefix is that many folders up, whatever --prefix says.
file(RELATIVE_PATH ATTND_PC_TO_PREFIX "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
configure_file(${CMAKE_CURRENT_LIST_DIR}/attnd-client.pc.in ${CMAKE_CURRENT_BINARY_DIR}/attnd-client.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/attnd-client.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
