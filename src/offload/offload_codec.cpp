// Encoding of offloaded tensors: dense stage (lossless or lossy), then zstd
// or lz4 on its bytes. See src/offload/offload_codec.h.
#include "offload_codec.h"

#include <lz4.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <remat/error.h>

namespace remat::detail {
namespace {

constexpr int kZstdLevel = 1;              // ~300+ MB/s per core here; higher levels gain little on floats
constexpr double kFloat8Max = 448;         // largest finite float8 e4m3fn
constexpr int64_t kInt8BlockValues = 256;  // values per block of Codec::kInt8Block (one float32 scale each)

std::vector<int64_t> vec(c10::IntArrayRef a) { return {a.begin(), a.end()}; }

/** t as a dense CPU tensor in t's stride order (no copy when it already is). */
at::Tensor dense_cpu(const at::Tensor& t) {
  at::Tensor c = t.device().is_cpu() ? t : t.to(at::kCPU);
  if (c.is_non_overlapping_and_dense()) return c;
  return at::empty_like(c).copy_(c);  // empty_like keeps the stride order, drops the gaps
}

/** The 256 levels of Codec::kInt8Block, ascending, in [-1, 1]: 0, 1 and,
 *  for each decade d = 1e-6 .. 1 (e = 0 .. 6), 2^e levels of either sign at
 *  the middles of 2^e equal bins of [0.1 d, d]: 7 decades of range, and the
 *  finest steps near 1 (2 + 2 x 127 = 256). */
const at::Tensor& int8_levels() {
  static const at::Tensor levels = [] {
    std::vector<float> v{0.0F, 1.0F};
    for (int e = 0; e < 7; ++e) {
      const int n = 1 << e;
      const double decade = std::pow(10.0, e - 6);
      for (int i = 0; i < n; ++i) {
        const double lo = 0.1 + 0.9 * i / n, hi = 0.1 + 0.9 * (i + 1) / n;
        const auto x = static_cast<float>(decade * (lo + hi) / 2);
        v.push_back(x);
        v.push_back(-x);
      }
    }
    std::sort(v.begin(), v.end());
    return at::tensor(v, at::kFloat);
  }();
  return levels;
}

/** The midpoints between neighbouring levels: searchsorted on them gives
 *  each value's nearest level. */
const at::Tensor& int8_bounds() {
  static const at::Tensor bounds = [] {
    const at::Tensor& l = int8_levels();
    return ((l.narrow(0, 0, l.numel() - 1) + l.narrow(0, 1, l.numel() - 1)) / 2).contiguous();
  }();
  return bounds;
}

// NOTE [int8 codec in place]: both directions run one block at a time
// straight from the source into the result, allocating nothing else. The
// whole-tensor ATen form took as much again as the state tensor 4x over to
// encode (a padded copy, the quotients, searchsorted's int64 indices) and
// 6x to decode (int64 codes, per-value scales, the gathered levels), inside
// the parameter's update in backward, which auto's plan does not count: its
// first planned steps ran up to 90% over their budgets. Same values bit for
// bit: the same float division, the first bound >= the quotient
// (searchsorted's), the same float product.

/** Codec::kInt8Block of a dense float32 CPU tensor, or false when it holds
 *  inf or NaN (stored raw then). */
bool encode_int8_block(const at::Tensor& dense, Encoded& e) {
  const int64_t n = dense.numel(), blocks = (n + kInt8BlockValues - 1) / kInt8BlockValues;
  const float* src = dense.data_ptr<float>();  // its elements fill [src, src + n) (dense; negation resolved)
  // Finite first: a tensor with inf or NaN is stored raw.
  std::atomic<bool> finite{true};
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (!std::isfinite(src[i])) {
        finite = false;
        return;
      }
    }
  });
  if (!finite) return false;
  at::Tensor stage = at::empty({blocks * 4 + n}, at::kByte);
  auto* scales = reinterpret_cast<float*>(stage.data_ptr<uint8_t>());
  uint8_t* codes = stage.data_ptr<uint8_t>() + blocks * 4;
  const at::Tensor& bounds_t = int8_bounds();
  const float* bounds = bounds_t.data_ptr<float>();
  const float* bounds_end = bounds + bounds_t.numel();
  at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t first = b * kInt8BlockValues, last = std::min(n, first + kInt8BlockValues);
      float amax = 0;
      for (int64_t i = first; i < last; ++i) amax = std::max(amax, std::abs(src[i]));
      const float scale = amax > 0 ? amax : 1.0F;
      std::memcpy(scales + b, &scale, sizeof scale);
      for (int64_t i = first; i < last; ++i) {
        const float q = src[i] / scale;
        codes[i] = static_cast<uint8_t>(std::lower_bound(bounds, bounds_end, q) - bounds);
      }
    }
  });
  e.block = kInt8BlockValues;
  e.dense_strides = vec(dense.strides());
  e.data = stage;
  e.lossy = true;
  return true;
}

/** The float32 tensor a kInt8Block stage stands for. */
at::Tensor decode_int8_block(const TensorMeta& m, const Encoded& e, const at::Tensor& stage) {
  int64_t n = 1;
  for (int64_t s : m.sizes) n *= s;
  const int64_t blocks = (n + e.block - 1) / e.block;
  const at::Tensor bytes = stage.contiguous();
  const uint8_t* codes = bytes.data_ptr<uint8_t>() + blocks * 4;
  const uint8_t* scales = bytes.data_ptr<uint8_t>();
  const float* levels = int8_levels().data_ptr<float>();
  at::Tensor out = at::empty_strided(m.sizes, e.dense_strides, at::kFloat);
  float* dst = out.data_ptr<float>();  // fills [dst, dst + n) (dense)
  at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      float scale;
      std::memcpy(&scale, scales + b * 4, sizeof scale);
      const int64_t first = b * e.block, last = std::min(n, first + e.block);
      for (int64_t i = first; i < last; ++i) dst[i] = levels[codes[i]] * scale;
    }
  });
  return out;
}

}  // namespace

TensorMeta meta_of(const at::Tensor& t) {
  return {vec(t.sizes()), vec(t.strides()), t.scalar_type(), t.device(), static_cast<int64_t>(t.nbytes())};
}

Encoded encode(const at::Tensor& t, Codec codec, bool exact_size) {
  Encoded e;
  at::Tensor stage = dense_cpu(t);
  const bool lossy = (codec == Codec::kBFloat16 || codec == Codec::kFloat8 || codec == Codec::kInt8Block) &&
                     t.scalar_type() == at::kFloat;
  if (lossy && codec == Codec::kInt8Block) {
    stage = stage.resolve_neg();  // the loops read raw memory (a no-op unless a negative view)
    if (!stage.is_non_overlapping_and_dense()) stage = dense_cpu(stage);
    if (encode_int8_block(stage, e)) stage = e.data;
  } else if (lossy && codec == Codec::kBFloat16) {
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
  if (e.block > 0) return at::empty({e.stage_bytes}, at::kByte);
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
  if (e.block > 0) {
    stage = decode_int8_block(m, e, stage);
  } else if (e.lossy) {
    at::Tensor f = stage.to(at::kFloat);
    if (e.scale != 1.0) f.mul_(e.scale);
    stage = f;
  }
  if (!m.device.is_cpu()) stage = stage.to(m.device);
  return stage;
}

}  // namespace remat::detail
