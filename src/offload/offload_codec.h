// Internal: how offload encodes one saved tensor into bytes and back.
// Lossless codecs store the tensor's elements in a dense layout with the
// same stride order as the original (at::empty_like's rule), so the tensor
// comes back with the same layout class and bitwise equal values; zstd and
// lz4 (Debian's libzstd, liblz4) then compress those bytes, and the raw bytes
// are kept whenever compression does not make them smaller. Lossy codecs
// (bfloat16, scaled float8 e4m3, 8-bit codes in blocks) apply to float32
// only.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include <remat/offload.h>

namespace remat::detail {

/** What a tensor is (to rebuild it). */
struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::kCPU;
  int64_t nbytes = 0;  // numel * itemsize
};
TensorMeta meta_of(const at::Tensor& t);

enum class ByteCodec : uint8_t { kRaw, kZstd, kLz4 };

/** What is stored for one tensor. */
struct Encoded {
  /** The bytes to store: a dense CPU tensor (kRaw; its data_ptr() is the
   *  first of stored_bytes) or a uint8 buffer (compressed). */
  at::Tensor data;
  int64_t stored_bytes = 0;
  ByteCodec bytes = ByteCodec::kRaw;
  /** The dense tensor before byte compression ("stage"): its dtype (the
   *  original one unless lossy), strides, and size in bytes. */
  at::ScalarType stage_dtype = at::kFloat;
  std::vector<int64_t> stage_strides;
  int64_t stage_bytes = 0;
  bool lossy = false;
  double scale = 1.0;  // float8: stored = x / scale
  /** kInt8Block: values per block (0 otherwise). The stage is then a byte
   *  buffer: one float32 scale per block, then one code per value, in the
   *  memory order of the dense tensor whose strides are dense_strides. */
  int64_t block = 0;
  std::vector<int64_t> dense_strides;
};

/** The most bytes encode() holds beside a tensor of raw_bytes while it
 *  encodes it (its stage or compressed buffer), and a read beside the
 *  tensor it decodes into: 0 without a codec; else raw_bytes + raw_bytes /
 *  255 + 64, above zstd's and lz4's compressBound and a lossy stage. */
inline int64_t codec_buffer_bytes(Codec codec, int64_t raw_bytes) {
  return codec == Codec::kNone || raw_bytes <= 0 ? 0 : raw_bytes + raw_bytes / 255 + 64;
}

/** Encodes t (any device; copied to CPU). exact_size: shrink a compressed
 *  buffer to its size (worth a copy when it stays in memory). Runs torch
 *  ops: call with grad off and remat's interception suspended. */
Encoded encode(const at::Tensor& t, Codec codec, bool exact_size);

/** A CPU tensor with the stage's sizes, strides and dtype, to read raw bytes
 *  into (kRaw) before finish(). */
at::Tensor empty_stage(const TensorMeta& m, const Encoded& e);

/** Decompresses src (stored_bytes of e.bytes) into a stage tensor. Throws
 *  remat::Error naming `what` when the data is not what was written. */
at::Tensor decompress(const TensorMeta& m, const Encoded& e, const void* src, int64_t size, const std::string& what);

/** The stage back to the original dtype, layout and device. */
at::Tensor finish(const TensorMeta& m, const Encoded& e, at::Tensor stage);

}  // namespace remat::detail
