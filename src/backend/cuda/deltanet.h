// Launcher of the Gated DeltaNet (deltanet.cu): the same function as Backend::gated_delta_net,
// token by token on the GPU. Buffers, vectors and state in device memory.
#pragma once

#include <cuda_runtime.h>

#include "backend/backend.h"

namespace moestream::cuda {

class Scratch;

void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a,
                     const DeltaNetWeights& w, const DeltaNetParams& p, DeltaNetState& state, Buffer& out,
                     Scratch& scratch, cudaStream_t s);

}  // namespace moestream::cuda
