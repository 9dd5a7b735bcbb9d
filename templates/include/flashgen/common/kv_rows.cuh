// Where a request's KV token lives: the element offset of its row (token, head 0) in the K/V tensors.
//   Paged: page = page_list[t / PAGE_SIZE], row = page * stride_page + (t % PAGE_SIZE) * stride_token
//   Ragged: row = (kv_indptr[request] + t) * stride_token
// page_list is the request's page ids: kv_indices + kv_indptr[request] (CSR) or a block_table row.
// PAGE_SIZE is a compile-time constant, so the division is a shift or a multiply-high.
#pragma once
#include <cstdint>

namespace flashgen {

template <bool PAGED, int PAGE_SIZE>
struct KVRows {
  const int32_t* page_list;  // paged: this request's page ids
  int64_t first_row;         // ragged: kv_indptr[request]
  int64_t stride_page, stride_token;

  KVRows() = default;  // so that a KVRows can sit in shared memory
  template <typename Params>
  __device__ __forceinline__ KVRows(const Params& p, int request) : stride_page(p.stride_page), stride_token(p.stride_token) {
    if constexpr (PAGED) {
      page_list = p.block_table != nullptr ? p.block_table + int64_t(request) * p.block_table_stride
                                           : p.kv_indices + p.kv_indptr[request];
      first_row = 0;
    } else {
      page_list = nullptr;
      first_row = p.kv_indptr[request];
    }
  }

  // the page id load for token t: issued early, its value consumed by offset() later
  __device__ __forceinline__ int32_t page(int t) const {
    if constexpr (PAGED) return __ldg(page_list + t / PAGE_SIZE);
    else return 0;
  }

  __device__ __forceinline__ int64_t offset(int t, int32_t page_id) const {
    if constexpr (PAGED) return int64_t(page_id) * stride_page + int64_t(t % PAGE_SIZE) * stride_token;
    else return (first_row + t) * stride_token;
  }
};

}  // namespace flashgen
