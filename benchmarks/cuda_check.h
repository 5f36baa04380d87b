// CHECK(call): the standalone probes' check of a CUDA runtime call (prints the error and the
// line, exits with 1).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                              \
  do {                                                                        \
    cudaError_t e = (x);                                                      \
    if (e != cudaSuccess) {                                                   \
      printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__);        \
      exit(1);                                                                \
    }                                                                         \
  } while (0)
