// Encoding of offloaded tensors: dense stage (lossless or lossy), then zstd
// or lz4 on its bytes. See src/offload/offload_codec.h.
#include "offload_codec.h"

#include <lz4.h>
#include <zstd.h>

#include <cmath>
#include <cstring>

#include <ATen/ATen.h>

#include <remat/error.h>

namespace remat::detail {
namespace {

constexpr int kZstdLevel = 1;       // ~300+ MB/s per core here; higher levels gain little on floats
constexpr double kFloat8Max = 448;  // largest finite float8 e4m3fn

std::vector<int64_t> vec(c10::IntArrayRef a) { return {a.begin(), a.end()}; }

/** t as a dense CPU tensor in t's stride order (no copy when it already is). */
at::Tensor dense_cpu(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.to(at::kCPU);
  if (c.is_non_overlapping_and_dense()) return c;
  return at::empty_like(c).copy_(c);  // empty_like keeps the stride order, drops the gaps
}

}  // namespace

TensorMeta meta_of(const at::Tensor& t) {
  return {vec(t.sizes()), vec(t.strides()), t.scalar_type(), t.device(), static_cast<int64_t>(t.nbytes())};
}

Encoded encode(const at::Tensor& t, Codec codec, bool exact_size) {
  Encoded e;
  at::Tensor stage = dense_cpu(t);
  const bool lossy = (codec == Codec::kBFloat16 || codec == Codec::kFloat8) && t.scalar_type() == at::kFloat;
  if (lossy && codec == Codec::kBFloat16) {
    stage = stage.to(at::kBFloat16);  // keeps the strides of a dense tensor
    e.lossy = true;
  } else if (lossy) {
    const double amax = stage.numel() ? stage.abs().max().item<double>() : 0.0;
    if (std::isfinite(amax)) {  // inf / NaN cannot be scaled: stored raw
      e.scale = amax > 0 ? amax / kFloat8Max : 1.0;
      stage = (stage / e.scale).to(at::kFloat8_e4m3fn);
      e.lossy = true;
    }
  }
  e.stage_dtype = stage.scalar_type();
  e.stage_strides = vec(stage.strides());
  e.stage_bytes = static_cast<int64_t>(stage.nbytes());
  e.data = stage;
  e.stored_bytes = e.stage_bytes;
  if ((codec != Codec::kZstd && codec != Codec::kLz4) || e.stage_bytes == 0) return e;

  const auto* src = static_cast<const char*>(stage.data_ptr());
  const auto n = static_cast<size_t>(e.stage_bytes);
  at::Tensor buf;
  int64_t size = 0;
  if (codec == Codec::kZstd) {
    buf = at::empty({static_cast<int64_t>(ZSTD_compressBound(n))}, at::kByte);
    const size_t r = ZSTD_compress(buf.data_ptr(), buf.numel(), src, n, kZstdLevel);
    if (ZSTD_isError(r)) {
      throw Error(std::string("[remat::offload] zstd failed to compress ") + format_bytes(e.stage_bytes) + ": " +
                  ZSTD_getErrorName(r) + ". Use codec(Codec::kLz4) or kNone.");
    }
    size = static_cast<int64_t>(r);
  } else {
    if (n > static_cast<size_t>(LZ4_MAX_INPUT_SIZE)) return e;  // beyond lz4's one-shot API: raw
    buf = at::empty({LZ4_compressBound(static_cast<int>(n))}, at::kByte);
    const int r = LZ4_compress_default(src, static_cast<char*>(buf.data_ptr()), static_cast<int>(n),
                                       static_cast<int>(buf.numel()));
    if (r <= 0) return e;  // lz4 reports only "did not fit": keep the raw bytes
    size = r;
  }
  if (size >= e.stage_bytes) return e;  // incompressible: raw is smaller and free to read
  if (exact_size) {
    at::Tensor exact = at::empty({size}, at::kByte);
    std::memcpy(exact.data_ptr(), buf.data_ptr(), static_cast<size_t>(size));
    buf = exact;
  }
  e.data = buf;
  e.stored_bytes = size;
  e.bytes = codec == Codec::kZstd ? ByteCodec::kZstd : ByteCodec::kLz4;
  return e;
}

at::Tensor empty_stage(const TensorMeta& m, const Encoded& e) {
  return at::empty_strided(m.sizes, e.stage_strides, at::TensorOptions().dtype(e.stage_dtype));
}

at::Tensor decompress(const TensorMeta& m, const Encoded& e, const void* src, int64_t size, const std::string& what) {
  at::Tensor stage = empty_stage(m, e);
  if (size != e.stored_bytes) {
    throw Error("[remat::offload] " + what + " holds " + format_bytes(size) + " but " + format_bytes(e.stored_bytes) +
                " were stored; it was truncated or replaced. Keep the offload directory private to this process.");
  }
  const auto dst_n = static_cast<size_t>(e.stage_bytes);
  bool ok = true;
  if (e.bytes == ByteCodec::kRaw) {
    std::memcpy(stage.data_ptr(), src, dst_n);
  } else if (e.bytes == ByteCodec::kZstd) {
    const size_t r = ZSTD_decompress(stage.data_ptr(), dst_n, src, static_cast<size_t>(size));
    ok = !ZSTD_isError(r) && r == dst_n;
  } else {
    const int r = LZ4_decompress_safe(static_cast<const char*>(src), static_cast<char*>(stage.data_ptr()),
                                      static_cast<int>(size), static_cast<int>(dst_n));
    ok = r >= 0 && static_cast<size_t>(r) == dst_n;
  }
  if (!ok) {
    throw Error("[remat::offload] " + what +
                " does not decompress to the tensor that was stored (corrupted). Keep the offload directory "
                "private to this process.");
  }
  return stage;
}

at::Tensor finish(const TensorMeta& m, const Encoded& e, at::Tensor stage) {
  if (e.lossy) {
    at::Tensor f = stage.to(at::kFloat);
    if (e.scale != 1.0) f.mul_(e.scale);
    stage = f;
  }
  if (!m.device.is_cpu()) stage = stage.to(m.device);
  return stage;
}

}  // namespace remat::detail
