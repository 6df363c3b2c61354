# cmake -DIN=file -DOUT=file.cpp -DNAME=symbol -P embed_file.cmake
# Writes OUT, a C++ source defining `const char moestream::NAME[]` with the text of IN, so static
# files (the web chat page) are compiled into the binary with no build tool beyond CMake.
file(READ "${IN}" content)
string(FIND "${content}" ")moestream_embed" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter )moestream_embed")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/embed_file.cmake; do not edit.\nnamespace moestream {\nextern const char ${NAME}[];\nconst char ${NAME}[] = R\"moestream_embed(")
file(APPEND "${OUT}.tmp" "${content}")
file(APPEND "${OUT}.tmp" ")moestream_embed\";\n}  // namespace moestream\n")
execute_process(COMMAND ${CMAKE_COMMAND} -E copy_if_different "${OUT}.tmp" "${OUT}")
file(REMOVE "${OUT}.tmp")
