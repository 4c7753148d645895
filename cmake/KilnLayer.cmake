# kiln_layer(NAME DEPS...): a static library kiln_NAME from every .cpp in the calling folder
# (subfolders included). An empty layer still builds.
function(kiln_layer name)
  file(GLOB_RECURSE srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  if(NOT srcs)
    set(stub ${CMAKE_CURRENT_BINARY_DIR}/kiln_${name}_empty.cpp)
    file(WRITE ${stub} "// layer ${name} has no sources yet\n")
    set(srcs ${stub})
  endif()
  add_library(kiln_${name} STATIC ${srcs})
  target_include_directories(kiln_${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_compile_options(kiln_${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KILN_WARNINGS}>)
  target_link_libraries(kiln_${name} PUBLIC ${ARGN})
endfunction()
