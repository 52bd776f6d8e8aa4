// pdserve::decode_attention on a CPU: one query per row over the row's keys and values, read in
// position order (see decode_attention.py for why and for the operator's contract).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// A head's best score above which a position its mask leaves out weighs exactly 0 in the full
// computation too: that position's score is -inf or about the lowest float (unless its product of
// query and key nears float's maximum), and exp of anything under -1e38 is 0 in float32.
constexpr float kLowestWeighed = -1e30f;

inline void add_scaled(float* out, const float* x, float scale, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] += scale * x[i];
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& query, const at::Tensor& key,
                                                    const at::Tensor& value,
                                                    const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "decode_attention: query, key and value must be [rows, heads, positions, width]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "decode_attention: float32 only");
  TORCH_CHECK(query.size(2) == 1, "decode_attention: one query per row");
  const int64_t rows = query.size(0), heads = query.size(1), width = query.size(3);
  const int64_t kv_heads = key.size(1), positions = key.size(2), value_width = value.size(3);
  TORCH_CHECK(key.size(0) == rows && value.size(0) == rows && value.size(1) == kv_heads &&
                  value.size(2) == positions && key.size(3) == width,
              "decode_attention: key and value do not match the query");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "decode_attention: heads must be a multiple of kv heads");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1,
              "decode_attention: key and value rows must be dense");
  const float* mask_data = nullptr;
  int64_t mask_row = 0, mask_position = 0;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 4 && m.size(0) == rows && m.size(1) == 1 &&
                    m.size(2) == 1 && m.size(3) == positions,
                "decode_attention: the mask must be float32 [rows, 1, 1, positions]");
    mask_data = m.const_data_ptr<float>();
    mask_row = m.stride(0);
    mask_position = m.stride(3);
  }
  const at::Tensor q = query.contiguous();
  at::Tensor out = at::empty({rows, 1, heads, value_width}, query.options());
  at::Tensor lse = at::empty({rows, heads}, query.options());
  const float* q_data = q.const_data_ptr<float>();
  const float* k_data = key.const_data_ptr<float>();
  const float* v_data = value.const_data_ptr<float>();
  float* out_data = out.mutable_data_ptr<float>();
  float* lse_data = lse.mutable_data_ptr<float>();
  const int64_t group = heads / kv_heads;
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), ks2 = key.stride(2);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1), vs2 = value.stride(2);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const float score_scale = static_cast<float>(scale);

  // Where a row attends to some positions, those its mask leaves out (-inf, or the lowest float as
  // transformers' masks have it) weigh exactly 0 (their exponentials underflow), so only the others
  // are read: a batch context's padding past a row's length, and whatever lies there, is not.
  const auto masked_out = [&](float bias) {
    return bias == minus_inf || bias == std::numeric_limits<float>::lowest();
  };

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * positions);
    std::vector<float> maxima(heads), sums(heads);
    std::vector<int64_t> live;
    live.reserve(positions);

    // Scores of the ``count`` positions ``at(i)``, softmax, and the weighted values; false (nothing
    // written) where ``check`` finds a head whose best score leaves the skipped positions a weight.
    const auto attend = [&](int64_t row, int64_t count, auto at, bool check) {
      const float* qr = q_data + row * heads * width;
      std::fill(maxima.begin(), maxima.end(), minus_inf);
      // Keys, position by position (every head of a position lies together in a batch context).
      for (int64_t i = 0; i < count; ++i) {
        const int64_t p = at(i);
        const float bias = mask_data ? mask_data[row * mask_row + p * mask_position] : 0.f;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          const float* kp = k_data + row * ks0 + kh * ks1 + p * ks2;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            const float s = dot(qr + h * width, kp, width) * score_scale + bias;
            scores[h * count + i] = s;
            maxima[h] = std::max(maxima[h], s);
          }
        }
      }
      if (check) {
        for (int64_t h = 0; h < heads; ++h) {
          if (!(maxima[h] > kLowestWeighed)) return false;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sh = scores.data() + h * count;
        const float m = maxima[h];
        float sum = 0.f;
        if (m != minus_inf) {
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < count; ++i) {
            const float e = std::exp(sh[i] - m);
            sh[i] = e;
            sum += e;
          }
        } else {
          std::fill(sh, sh + count, 0.f);
        }
        sums[h] = sum;
        lse_data[row * heads + h] = m == minus_inf ? minus_inf : m + std::log(sum);
      }
      float* orow = out_data + row * heads * value_width;
      std::fill(orow, orow + heads * value_width, 0.f);
      // Values, position by position.
      for (int64_t i = 0; i < count; ++i) {
        const int64_t p = at(i);
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          const float* vp = v_data + row * vs0 + kh * vs1 + p * vs2;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kh * group + g;
            add_scaled(orow + h * value_width, vp, scores[h * count + i], value_width);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float inverse = sums[h] > 0.f ? 1.f / sums[h] : 0.f;
        float* oh = orow + h * value_width;
        for (int64_t i = 0; i < value_width; ++i) oh[i] *= inverse;
      }
      return true;
    };

    for (int64_t row = begin; row < end; ++row) {
      live.clear();
      if (mask_data) {
        for (int64_t p = 0; p < positions; ++p) {
          if (!masked_out(mask_data[row * mask_row + p * mask_position])) live.push_back(p);
        }
      }
      const int64_t count = static_cast<int64_t>(live.size());
      if (count > 0 && count < positions &&
          attend(row, count, [&](int64_t i) { return live[i]; }, true)) {
        continue;
      }
      attend(row, positions, [](int64_t i) { return i; }, false);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decode_attention", &decode_attention); }
