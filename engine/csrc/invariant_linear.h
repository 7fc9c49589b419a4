// What other ops of the library call of invariant_linear.cpp.
#pragma once

#include <ATen/ATen.h>

#include <vector>

// Rows [offsets[g], offsets[g + 1]) of x times the packed weight packed[experts[g]] (with
// scales[experts[g]] where scales is defined), every group the same out_features N: the same
// bits as invariant_linear_grouped. Hidden, so that each build loaded into one process (the
// tests load several) calls its own.
__attribute__((visibility("hidden"))) at::Tensor grouped_stacked(const at::Tensor& x, const at::Tensor& packed,
                                                                 const at::Tensor& scales,
                                                                 const std::vector<int64_t>& experts,
                                                                 const std::vector<int64_t>& offsets, int64_t N);
