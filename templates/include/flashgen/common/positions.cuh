// Explicit true positions (the `positions` kernel option): a request's keys need not be numbered by their place
// in its page list (cascade levels, kept blocks, kept pages), nor its queries by kv_len - qo_len.
//   key t of request b (its place in the page list) sits at kv_page_pos[kv_indptr[b] + t / PAGE_SIZE] + t % PAGE_SIZE
//   (kv_page_pos is parallel to kv_indices: the true position of each page's first token; Ragged: of each token)
//   query token i of the batch sits at q_pos[i]
// Kernels read these only when the option is on; a default kernel's params have no such fields.
#pragma once
#include <cstdint>

namespace flashgen {

// this request's kv_page_pos entries
template <typename Params>
__device__ __forceinline__ const int32_t* request_page_pos(const Params& p, int request) {
  return p.kv_page_pos + p.kv_indptr[request];
}

// the true position of key t (t < the request's KV length) of a request whose entries start at page_pos
template <int PAGE_SIZE>
__device__ __forceinline__ int key_position(const int32_t* page_pos, int t) {
  return __ldg(page_pos + t / PAGE_SIZE) + t % PAGE_SIZE;
}

}  // namespace flashgen
