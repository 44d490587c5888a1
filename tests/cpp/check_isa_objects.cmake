# The ISA translation units (attention_avx2.cc, attention_avx512*.cc, stream_read_avx*.cc) are
# each compiled with their own -m flags. A weak (inline, template) or unique symbol they define
# is merged by the linker with the other levels' copies of it, and one copy, from whichever
# unit, runs at every level: an AVX-512 copy on an AVX2-only CPU is an illegal instruction.
# Fails if any such object defines one (the kernels' headers keep their code in an unnamed
# namespace for this). Run by ctest: cmake -DNM=<nm> -DOBJECTS=<list> -P check_isa_objects.cmake
set(checked 0)
foreach(obj IN LISTS OBJECTS)
  get_filename_component(name "${obj}" NAME)
  if(NOT name MATCHES "_avx")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  execute_process(COMMAND "${NM}" -C --defined-only "${obj}" OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nm failed on ${obj}")
  endif()
  string(REGEX MATCHALL "[^\n]* [WVu] [^\n]*" shared "${syms}")
  if(shared)
    string(REPLACE ";" "\n  " shared "${shared}")
    message(FATAL_ERROR "${name} defines symbols shared with other ISA levels:\n  ${shared}")
  endif()
endforeach()
if(checked LESS 2)
  message(FATAL_ERROR "expected the ISA objects among OBJECTS, found ${checked}")
endif()
message(STATUS "${checked} ISA objects: no weak or unique symbols")
