// The split-KV list paths of flashgen/plan/list_paths.py (prefill: small_inputs, _sizes, plan_lists, and
// finish_plan's padding; decode: plan_decode_lists) in one call, for the default split policy
// (flashgen/plan/heuristics.py). Each call writes the plan's int32 fields into the caller's host buffer at the
// offsets of fast_paths.split_kv_layout and returns the SplitKVInfo (set_info_type); or the number of
// int32 elements the plan needs, when no buffer (or too small a one) was given; or None wherever the Python
// path has the say: inputs it refuses or converts, PlanErrors (capacity, sizes), bounds and batches past the
// list paths'. The Python path then plans (or raises) as it always has, so None is never a wrong answer.
//
// Integer arithmetic is Python's: floor division of non-negative values, 128-bit products where Python's ints
// would pass 64 bits, and the float compares of the heuristics (an int against a float compared exactly, as
// Python does). Built with -ffp-contract=off: no fused multiply-add may change a float estimate.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace {

using i64 = long long;
using i128 = __int128;

// the Python side's constants (tests/plan/test_plan_native.py holds them equal)
constexpr i64 INT32_LIMIT = 1LL << 31;          // fast_paths.INT32_LIMIT
constexpr i64 MAX_KV_LEN = 1LL << 30;           // fast_paths.MAX_KV_LEN
constexpr Py_ssize_t SMALL_BATCH = 12;          // list_paths.SMALL_BATCH
constexpr Py_ssize_t SMALL_DECODE = 24;         // list_paths.SMALL_DECODE
constexpr i64 SMALL_ITEMS = 40;                 // list_paths._SMALL_ITEMS
constexpr i64 SMALL_SPLIT_ITEMS = 160;          // list_paths._SMALL_SPLIT_ITEMS
constexpr double ALONE_SPEEDUP = 1.39;          // heuristics.ALONE_SPEEDUP
constexpr i64 ALIGN = 4;                        // plan._ALIGN
constexpr i64 OPTION_LIMIT = INT32_LIMIT;       // sizes and options at or past it: the Python path
constexpr int MAX_TAIL_SPLIT = 8;               // heuristics.choose_tail_split tries k = 2 .. 8

PyTypeObject* ndarray_type = nullptr;  // numpy.ndarray
PyTypeObject* tensor_type = nullptr;   // torch.Tensor
PyTypeObject* info_type = &PyTuple_Type;  // SplitKVInfo (set_info_type), a tuple subclass of 14 fields

inline i64 ceil_div(i64 a, i64 b) { return a / b + (a % b != 0); }  // a >= 0, b > 0: Python's -(-a // b)
inline i128 ceil_div128(i128 a, i128 b) { return a / b + (a % b != 0); }
inline i64 align(i64 n) { return ceil_div(n, ALIGN) * ALIGN; }

// Python's `x < d` for an int x and a float d: exact, as CPython compares them
bool int_lt_float(i128 x, double d) {
    if (std::isnan(d)) return false;
    if (d > 0x1p100) return true;  // |x| < 2**100 here
    if (d < -0x1p100) return false;
    return x < static_cast<i128>(std::ceil(d));  // for an int x: x < d <=> x < ceil(d)
}

bool int_ge_float(i128 x, double d) { return !std::isnan(d) && !int_lt_float(x, d); }

// ------------------------------------------------------------------------------------------------ inputs

// a buffer held for the length of a call
struct Buffer {
    Py_buffer view{};
    bool held = false;
    ~Buffer() {
        if (held) PyBuffer_Release(&view);
    }
    bool get(PyObject* obj, int flags) {
        if (PyObject_GetBuffer(obj, &view, flags) != 0) {
            PyErr_Clear();
            return false;
        }
        held = true;
        return true;
    }
};

// the integer kind of a buffer's format: 1 signed, 2 unsigned, 0 other (floats, bools, foreign byte order)
int int_kind(const char* format) {
    if (format == nullptr) return 0;
    if (*format == '@' || *format == '=' || *format == '<') ++format;  // native: x86-64 and aarch64 are little-endian
    if (format[0] == '\0' || format[1] != '\0') return 0;
    if (std::strchr("bhilq", format[0])) return 1;
    if (std::strchr("BHILQ", format[0])) return 2;
    return 0;
}

// Reads a 1-D numpy integer array (itemsize 1-8, any strides) into out; false where the Python path decides.
// torch_only: only the dtypes host_array takes from a tensor (int8, int16, int32, int64, uint8).
bool read_array(PyObject* array, i64* out, Py_ssize_t max_n, Py_ssize_t min_n, Py_ssize_t* n, bool torch_only) {
    Buffer buf;
    if (!buf.get(array, PyBUF_STRIDES | PyBUF_FORMAT)) return false;
    const Py_buffer& v = buf.view;
    int kind = int_kind(v.format);
    if (v.ndim != 1 || kind == 0 || v.shape[0] > max_n || v.shape[0] < min_n) return false;
    if (torch_only && kind == 2 && v.itemsize != 1) return false;
    const char* p = static_cast<const char*>(v.buf);
    for (Py_ssize_t i = 0; i < v.shape[0]; ++i, p += v.strides[0]) {
        i64 x;
        switch (v.itemsize) {
            case 1: x = kind == 1 ? i64(*reinterpret_cast<const int8_t*>(p)) : i64(*reinterpret_cast<const uint8_t*>(p)); break;
            case 2: {
                int16_t s; uint16_t u;
                std::memcpy(&s, p, 2), std::memcpy(&u, p, 2);
                x = kind == 1 ? i64(s) : i64(u);
                break;
            }
            case 4: {
                int32_t s; uint32_t u;
                std::memcpy(&s, p, 4), std::memcpy(&u, p, 4);
                x = kind == 1 ? i64(s) : i64(u);
                break;
            }
            case 8: {
                std::memcpy(&x, p, 8);
                if (kind == 2 && x < 0) return false;  // past int64: numpy's astype(int64) wraps it negative
                break;
            }
            default: return false;
        }
        out[i] = x;
    }
    *n = v.shape[0];
    return true;
}

// Reads qo_indptr or kv_lens as the list paths take them (host_list): a numpy integer array, a CPU integer
// tensor, or (sequences_ok) a list or tuple of Python ints. Anything else, or a length outside [min_n, max_n]:
// false, and the Python path reads (or refuses) it.
bool read_ints(PyObject* obj, i64* out, Py_ssize_t max_n, Py_ssize_t min_n, Py_ssize_t* n, bool sequences_ok) {
    PyTypeObject* type = Py_TYPE(obj);
    if (type == ndarray_type) return read_array(obj, out, max_n, min_n, n, false);
    if (type == tensor_type) {
        // a CPU tensor's numpy() shares its memory; any other device raises (never a copy, never a sync)
        PyObject* array = PyObject_CallMethod(obj, "numpy", nullptr);
        if (array == nullptr) {
            PyErr_Clear();
            return false;
        }
        bool ok = Py_TYPE(array) == ndarray_type && read_array(array, out, max_n, min_n, n, true);
        Py_DECREF(array);
        return ok;
    }
    if (!sequences_ok || !(PyList_CheckExact(obj) || PyTuple_CheckExact(obj))) return false;
    Py_ssize_t size = PySequence_Fast_GET_SIZE(obj);
    if (size > max_n || size < min_n) return false;
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < size; ++i) {
        if (!PyLong_CheckExact(items[i])) return false;  // bools, numpy ints, floats: numpy converts or refuses them
        int overflow = 0;
        out[i] = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) return false;
    }
    *n = size;
    return true;
}

// an exact Python int in [lo, hi)
bool int_arg(PyObject* obj, i64 lo, i64 hi, i64* out) {
    if (!PyLong_CheckExact(obj)) return false;
    int overflow = 0;
    i64 v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || v < lo || v >= hi) return false;
    *out = v;
    return true;
}

// None (-1) or an exact Python int in [0, OPTION_LIMIT)
bool optional_int_arg(PyObject* obj, i64* out) {
    if (obj == Py_None) {
        *out = -1;
        return true;
    }
    return int_arg(obj, 0, OPTION_LIMIT, out);
}

bool truth_arg(PyObject* obj, bool* out) {
    int truth = PyObject_IsTrue(obj);
    if (truth < 0) {
        PyErr_Clear();
        return false;
    }
    *out = truth;
    return true;
}

// plan_split_kv's options (_check_options' conditions; anything it would refuse goes to the Python path)
struct Options {
    i64 num_qo_heads, num_kv_heads, group_size, tile_rows, granularity, num_sms, item_overhead;  // tile_rows -1: None
    bool enable_split = false, balance_tail = false;
    int min_waves = 0;  // split_min_waves: 0 None, 1 a float, 2 an int
    double min_waves_float = 0;
    i64 min_waves_int = 0;
    i64 max_batch_size, max_total_q, capacity;  // -1: None
    i64 partial_capacity;                         // -1: None (the plan's partial rows)
};

bool read_options(PyObject* const* a, Options* o) {
    // a: num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead
    if (!int_arg(a[0], 1, OPTION_LIMIT, &o->num_qo_heads) || !int_arg(a[1], 1, OPTION_LIMIT, &o->num_kv_heads) ||
        o->num_qo_heads % o->num_kv_heads || !int_arg(a[3], 1, OPTION_LIMIT, &o->granularity) ||
        !int_arg(a[4], 1, OPTION_LIMIT, &o->num_sms) || !int_arg(a[5], 0, OPTION_LIMIT, &o->item_overhead))
        return false;
    o->tile_rows = -1;
    if (a[2] != Py_None && !int_arg(a[2], 1, OPTION_LIMIT, &o->tile_rows)) return false;
    o->group_size = o->num_qo_heads / o->num_kv_heads;
    return true;
}

bool read_min_waves(PyObject* obj, Options* o) {
    if (obj == Py_None) {
        o->min_waves = 0;
    } else if (PyFloat_CheckExact(obj)) {  // a numpy float compares with an int inexactly: the Python path
        o->min_waves = 1;
        o->min_waves_float = PyFloat_AS_DOUBLE(obj);
    } else if (PyLong_Check(obj)) {  // an int (or a bool): Python's arithmetic stays exact
        int overflow = 0;
        o->min_waves = 2;
        o->min_waves_int = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow || o->min_waves_int >= OPTION_LIMIT || o->min_waves_int <= -OPTION_LIMIT) return false;
    } else {
        return false;
    }
    return true;
}

// split_kv._sizes for a valid batch; false where it raises (or would read non-int sizes). longest_q -1: decode.
bool resolve_sizes(Options* o, PyObject* max_batch_size, PyObject* max_total_q, PyObject* capacity, i64 batch,
                   i64 total_q, i64 longest_q) {
    bool fixed = max_batch_size != Py_None;
    bool decode_shape;
    if (!optional_int_arg(capacity, &o->capacity)) return false;
    if (fixed) {
        if (!int_arg(max_batch_size, 0, OPTION_LIMIT, &o->max_batch_size) || !optional_int_arg(max_total_q, &o->max_total_q))
            return false;
        if (o->max_total_q < 0) o->max_total_q = o->max_batch_size;
        if (batch > o->max_batch_size || total_q > o->max_total_q) return false;
        decode_shape = o->max_total_q == o->max_batch_size;
    } else {
        o->max_batch_size = batch, o->max_total_q = total_q, decode_shape = longest_q < 0;
    }
    if (o->tile_rows < 0) {  // heuristics.default_tile_rows
        i64 longest = decode_shape ? 1 : fixed ? o->max_total_q : longest_q;
        i64 rows = longest * o->group_size;
        o->tile_rows = rows <= 16 ? 16 : rows <= 64 ? 64 : 128;
    }
    o->partial_capacity = -1;
    if (fixed) {
        i64 min_items = ceil_div(o->max_total_q * o->group_size, o->tile_rows) + o->max_batch_size;
        if (o->capacity < 0) o->capacity = min_items + 2 * ceil_div(o->num_sms, o->num_kv_heads);
        if (o->capacity >= OPTION_LIMIT) return false;  // (no host buffer holds it: the Python path says so)
        o->partial_capacity = o->capacity * ceil_div(o->tile_rows, o->group_size);
    }
    return true;
}

// ------------------------------------------------------------------------------------------------ the policy

// heuristics.fills_waves
bool fills_waves(i64 work, const Options& o, i64 max_len) {
    i128 lhs = i128(work) * o.num_kv_heads;
    if (o.min_waves == 0) return false;
    if (o.min_waves == 2) return lhs >= i128(o.min_waves_int) * o.num_sms * max_len;
    return int_ge_float(lhs, o.min_waves_float * double(o.num_sms) * double(max_len));
}

// heuristics.split_candidates: chunk lengths, longest first
int split_candidates(i64 max_len, i64 work, const Options& o, i64* out) {
    i128 per_sm = i128(work) * o.num_kv_heads / o.num_sms;
    i128 divisor = per_sm > o.granularity ? per_sm : i128(o.granularity);
    i64 s0 = i64(ceil_div128(max_len, divisor));
    const i64 splits[] = {1, s0 - 2, s0 - 1, s0, s0 + 1, s0 + 2, 2 * s0, 4 * s0, 8 * s0};
    int count = 0;
    for (i64 s : splits) {
        if (s <= 0) continue;
        i64 chunk = ceil_div(ceil_div(max_len, s), o.granularity) * o.granularity;
        if (std::find(out, out + count, chunk) == out + count) out[count++] = chunk;
    }
    std::sort(out, out + count, [](i64 a, i64 b) { return a > b; });
    return count;
}

// heuristics.pick_chunk: the index of the chosen chunk (items in *items), or -1 where it raises (capacity)
int pick_chunk(const i64* chunk, const i64* counted, int count, i64 empty, i64 max_len, i64 work, const Options& o,
               i64* items) {
    int best_at = -1;
    double bar = HUGE_VAL;
    i128 total = i128(work) * o.num_kv_heads, per_item = i128(o.item_overhead) * o.num_kv_heads;
    for (int at = 0; at < count; ++at) {
        i64 n = counted[at] + empty;
        if (o.capacity >= 0 && n > o.capacity) continue;
        i64 longest = (chunk[at] < max_len ? chunk[at] : max_len) + o.item_overhead;
        i128 estimate = ceil_div128(total + per_item * n, i128(o.num_sms) * longest) * longest;
        if (int_lt_float(estimate, bar)) {  // ties (within 1 %) keep the longer chunk
            best_at = at, *items = n;
            bar = double(estimate) / 1.01;
        }
    }
    return best_at;
}

// heuristics.wave_time, with an int `work` (the unsplit wave: Python keeps ints until a float enters)
double wave_time_int(i64 pieces, i64 work, i64 slots) {
    i64 rounds = pieces / slots, left = pieces % slots;
    i128 base = i128(rounds) * work;
    if (left == 0) return double(base);
    if (2 * left > slots) return double(base + work);
    return double(base) + double(work) / ALONE_SPEEDUP;
}

double wave_time(i64 pieces, double work, i64 slots) {
    i64 rounds = pieces / slots, left = pieces % slots;
    double base = double(rounds) * work;
    return base + (left == 0 ? 0.0 : 2 * left > slots ? work : work / ALONE_SPEEDUP);
}

// fast_paths.tail_split with heuristics.choose_tail_split: false for None, else (m, k)
bool tail_split(const Options& o, i64 num_items, i64 item_len, i64* m_out, i64* k_out) {
    if (!(o.enable_split && o.balance_tail && num_items && o.tile_rows % o.group_size == 0)) return false;
    i64 ctas = num_items * o.num_kv_heads;
    if (ctas <= o.num_sms || item_len < 2 * o.granularity) return false;
    i64 r = ctas % o.num_sms;
    if (r == 0) return false;
    i64 m = ceil_div(r, o.num_kv_heads);
    i64 work = item_len + o.item_overhead;
    bool found = false;
    double best_time = wave_time_int(m * o.num_kv_heads, work, o.num_sms);
    for (i64 k = 2; k <= MAX_TAIL_SPLIT; ++k) {
        if (double(item_len) / double(k) < double(o.granularity) || (o.capacity >= 0 && m * (k - 1) > o.capacity - num_items))
            break;
        double t = wave_time(m * o.num_kv_heads * k, double(work) / double(k) + double(2 * o.item_overhead), o.num_sms);
        if (t < 0.97 * best_time) {
            found = true, *m_out = m, *k_out = k;
            best_time = t;
        }
    }
    return found;
}

// ------------------------------------------------------------------------------------------------ the plan

struct Item {
    int32_t request, tile, chunk, start, end;
};

struct Ramp {  // tokens [first, end) have `rows` partial rows each
    i64 first, end, rows;
};

// where a plan's fields lie in the host buffer: fast_paths.split_kv_layout
struct Layout {
    i64 kv_at, chunks_at, merge_at, items_at, stride, numel;
    Layout(i64 max_batch_size, i64 max_total_q, i64 cap) {
        i64 per_request = align(max_batch_size);
        kv_at = align(max_batch_size + 1);
        chunks_at = kv_at + per_request;
        merge_at = chunks_at + per_request;
        items_at = merge_at + align(max_total_q + 1);
        stride = align(cap);
        numel = items_at + 5 * stride;
    }
};

// the host buffer: flat, a writable C-contiguous int32 numpy array, or None (then only its size is asked)
struct Target {
    Buffer buf;
    int32_t* data = nullptr;
    i64 size = -1;
    bool open(PyObject* flat) {
        if (flat == Py_None) return true;
        if (!buf.get(flat, PyBUF_ND | PyBUF_WRITABLE | PyBUF_FORMAT)) return false;
        if (buf.view.ndim != 1 || buf.view.itemsize != 4 || int_kind(buf.view.format) != 1) return false;
        data = static_cast<int32_t*>(buf.view.buf);
        size = buf.view.shape[0];
        return true;
    }
};

// Writes a plan of `items` (final order) into the target; the result for Python (info tuple or numel).
// merge_rows[t]: partial rows of token t (tokens without are 0); zero_gaps: the item rows' alignment gaps get
// zeros, as list_paths._pack_items writes them.
PyObject* write_plan(Target& target, const Options& o, const i64* qo, const i64* lens, const int32_t* chunks,
                     i64 batch, i64 total_q, const std::vector<Item>& items, const std::vector<Ramp>& ramps,
                     i64 kv_chunk, bool zero_gaps) {
    i64 n = i64(items.size());
    i64 cap = o.capacity < 0 ? n : o.capacity;
    if (n > cap) Py_RETURN_NONE;  // the capacity PlanError: the Python path raises it
    Layout at(o.max_batch_size, o.max_total_q, cap);
    if (target.data == nullptr || target.size < at.numel) return PyLong_FromLongLong(at.numel);
    int32_t* flat = target.data;
    for (i64 i = 0; i <= batch; ++i) flat[i] = int32_t(qo[i]);
    std::fill(flat + batch + 1, flat + o.max_batch_size + 1, int32_t(total_q));
    for (i64 i = 0; i < batch; ++i) flat[at.kv_at + i] = int32_t(lens[i]);
    std::fill(flat + at.kv_at + batch, flat + at.kv_at + o.max_batch_size, 0);
    std::copy(chunks, chunks + batch, flat + at.chunks_at);
    std::fill(flat + at.chunks_at + batch, flat + at.chunks_at + o.max_batch_size, 0);
    // merge_indptr: the running sum of the tokens' partial rows (ramps sorted and disjoint: write_ramps)
    int32_t* merge = flat + at.merge_at;
    i64 rows = 0, token = 0;
    merge[0] = 0;
    for (const auto& ramp : ramps) {
        std::fill(merge + token + 1, merge + ramp.first + 1, int32_t(rows));
        for (i64 t = ramp.first; t < ramp.end; ++t) merge[t + 1] = int32_t(rows += ramp.rows);
        token = ramp.end;
    }
    std::fill(merge + token + 1, merge + o.max_total_q + 1, int32_t(rows));
    int32_t* row[5];
    for (int f = 0; f < 5; ++f) row[f] = flat + at.items_at + f * at.stride;
    for (i64 i = 0; i < n; ++i) {
        const Item& it = items[i];
        row[0][i] = it.request, row[1][i] = it.tile, row[2][i] = it.chunk, row[3][i] = it.start, row[4][i] = it.end;
    }
    const int32_t pads[5] = {-1, 0, 0, 0, 0};  // request.ITEM_PADS
    for (int f = 0; f < 5; ++f) {
        std::fill(row[f] + n, row[f] + cap, pads[f]);
        if (zero_gaps && n) std::fill(row[f] + cap, row[f] + at.stride, 0);
    }
    i64 partial_capacity = o.partial_capacity < 0 ? rows : o.partial_capacity;
    const i64 info[13] = {batch, o.max_batch_size, total_q, o.max_total_q, n, cap, o.num_qo_heads, o.num_kv_heads,
                          o.group_size, o.tile_rows, kv_chunk, rows, partial_capacity};
    PyObject* out = info_type->tp_alloc(info_type, 14);  // a NamedTuple's instance is its tuple
    if (out == nullptr) return nullptr;
    for (int f = 0; f < 13; ++f) {
        PyObject* value = PyLong_FromLongLong(info[f]);
        if (value == nullptr) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, f, value);
    }
    PyObject* fixed = o.capacity >= 0 ? Py_True : Py_False;
    Py_INCREF(fixed);
    PyTuple_SET_ITEM(out, 13, fixed);
    return out;
}

// ------------------------------------------------------------------------------------------------ prefill

// list_paths.plan_lists after small_inputs and _sizes; fields as fast_paths.plan_numpy writes them
PyObject* plan_prefill(Target& target, const Options& o, const i64* qo, const i64* lens, i64 batch) {
    i64 qo_len[SMALL_BATCH], tiles[SMALL_BATCH];
    i64 total_q = qo[batch], g = o.group_size, max_len = 0, max_len_q = 0, tile_sum = 0;
    for (i64 r = 0; r < batch; ++r) {
        qo_len[r] = qo[r + 1] - qo[r];
        max_len = std::max(max_len, lens[r]);
        if (qo_len[r]) max_len_q = std::max(max_len_q, lens[r]);  // the longest KV of a request with queries
        tiles[r] = ceil_div(qo_len[r] * g, o.tile_rows);  // qo_len * g < 2**62: both < 2**31
        tile_sum += tiles[r];
        if (qo_len[r] * g >= INT32_LIMIT) Py_RETURN_NONE;  // the longest query's rows: list_paths' bound
    }
    if (tile_sum > SMALL_ITEMS) Py_RETURN_NONE;  // at least one item a tile: the numpy path
    // list_paths._list_chunk: the chunk, whether any request splits, and the items
    i64 gran = o.granularity;
    i64 kv_chunk = std::max(gran, ceil_div(max_len, gran) * gran), num_items = tile_sum;  // one chunk a request
    bool split = false;
    if (o.enable_split) {
        i64 work = 0;
        for (i64 r = 0; r < batch; ++r) work += tiles[r] * lens[r];
        if (!fills_waves(work, o, max_len)) {
            kv_chunk = gran;
            if (max_len_q > gran) {
                i64 chunk[9], counted[9];
                int count = split_candidates(max_len_q, work, o, chunk);
                for (int c = 0; c < count; ++c) {
                    counted[c] = 0;
                    for (i64 r = 0; r < batch; ++r) counted[c] += tiles[r] * ceil_div(std::max(lens[r], 1LL), chunk[c]);
                }
                int at = pick_chunk(chunk, counted, count, 0, max_len_q, work, o, &num_items);
                if (at < 0) Py_RETURN_NONE;  // the capacity PlanError
                kv_chunk = chunk[at];
                split = max_len > kv_chunk;  // (a request without queries counts too)
            }
        }
    }
    if (num_items > SMALL_SPLIT_ITEMS || i128(total_q) * ceil_div(max_len, kv_chunk) >= INT32_LIMIT) Py_RETURN_NONE;
    int32_t chunks[SMALL_BATCH];
    std::vector<Item> items;
    std::vector<Ramp> ramps;
    items.reserve(size_t(num_items));
    if (split) {  // list_paths._split_rows: (request, tile, chunk) order, then longest first (a stable sort)
        for (i64 r = 0; r < batch; ++r) {
            i64 x = lens[r], c = qo_len[r] ? ceil_div(std::max(x, 1LL), kv_chunk) : 0;
            chunks[r] = int32_t(c);
            for (i64 t = 0; t < tiles[r]; ++t) {
                if (c == 1) {
                    items.push_back({int32_t(r), int32_t(t), -1, 0, int32_t(x)});
                    continue;
                }
                for (i64 j = 0; j < c; ++j)  // chunk j < c - 1 ends at (j + 1) * kv_chunk < x
                    items.push_back({int32_t(r), int32_t(t), int32_t(j), int32_t(j * kv_chunk),
                                     int32_t(j < c - 1 ? (j + 1) * kv_chunk : x)});
            }
            if (c > 1) ramps.push_back({qo[r], qo[r + 1], c});
        }
        std::stable_sort(items.begin(), items.end(),
                         [](const Item& a, const Item& b) { return a.start - a.end < b.start - b.end; });
        return write_plan(target, o, qo, lens, chunks, batch, total_q, items, ramps, kv_chunk, true);
    }
    // a request's tiles in order, requests longest first (a stable sort)
    i64 order[SMALL_BATCH];
    for (i64 r = 0; r < batch; ++r) order[r] = r, chunks[r] = qo_len[r] ? 1 : 0;
    std::stable_sort(order, order + batch, [lens](i64 a, i64 b) { return lens[a] > lens[b]; });
    i64 m = 0, k = 0;
    if (tail_split(o, num_items, max_len_q, &m, &k)) {
        // list_paths._tail_rows: the first m items as up to k chunks of granularity multiples each
        std::vector<Item> head;
        for (i64 i = 0; i < batch && i64(head.size()) < m; ++i)
            for (i64 t = 0; t < tiles[order[i]] && i64(head.size()) < m; ++t) head.push_back({int32_t(order[i]), int32_t(t), -1, 0, 0});
        i64 tokens = o.tile_rows / g;
        for (const Item& h : head) {
            i64 length = lens[h.request];
            i64 per = std::min(std::max(ceil_div(length, gran), 1LL), k);
            i64 step = std::max(ceil_div(ceil_div(length, per), gran) * gran, gran);
            i64 c = std::max(ceil_div(length, step), 1LL);
            if (c == 1) {
                items.push_back({h.request, h.tile, -1, 0, int32_t(length)});
                continue;
            }
            for (i64 j = 0; j < c; ++j)  // chunk j < c - 1 ends at (j + 1) * step < length
                items.push_back({h.request, h.tile, int32_t(j), int32_t(j * step), int32_t(j < c - 1 ? (j + 1) * step : length)});
            i64 first = qo[h.request] + h.tile * tokens;  // tiles hold whole tokens
            ramps.push_back({first, std::min(first + tokens, qo[h.request + 1]), c});
        }
        std::sort(ramps.begin(), ramps.end(), [](const Ramp& a, const Ramp& b) { return a.first < b.first; });
    }
    i64 skipped = 0;
    for (i64 i = 0; i < batch; ++i) {
        i64 r = order[i];
        for (i64 t = 0; t < tiles[r]; ++t)
            if (skipped < m) ++skipped;  // a head item, split above
            else items.push_back({int32_t(r), int32_t(t), -1, 0, int32_t(lens[r])});
    }
    return write_plan(target, o, qo, lens, chunks, batch, total_q, items, ramps, kv_chunk, true);
}

// prefill(qo_indptr, kv_lens, flat, num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms,
//         item_overhead, enable_split, balance_tail, split_min_waves, max_batch_size, max_total_q, capacity)
PyObject* prefill(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_Format(PyExc_TypeError, "prefill: takes 15 arguments, got %zd", nargs);
        return nullptr;
    }
    // small_inputs: qo_indptr a host array of 1 .. SMALL_BATCH + 1 entries from 0, rising; kv_lens as many
    // as its requests, >= 0
    PyTypeObject* qo_type = Py_TYPE(args[0]);
    i64 qo[SMALL_BATCH + 1], lens[SMALL_BATCH];
    Py_ssize_t n_qo = 0, batch = 0;
    if ((qo_type != ndarray_type && qo_type != tensor_type) || !read_ints(args[0], qo, SMALL_BATCH + 1, 1, &n_qo, false))
        Py_RETURN_NONE;
    if (qo[0] != 0) Py_RETURN_NONE;
    i64 longest_q = 0;
    for (Py_ssize_t r = 1; r < n_qo; ++r) {
        if (qo[r] < qo[r - 1] || qo[r] >= INT32_LIMIT) Py_RETURN_NONE;  // (total_q >= 2**31: list_paths' bound)
        longest_q = std::max(longest_q, qo[r] - qo[r - 1]);
    }
    if (!read_ints(args[1], lens, n_qo - 1, n_qo - 1, &batch, true)) Py_RETURN_NONE;
    for (Py_ssize_t r = 0; r < batch; ++r)
        if (lens[r] < 0 || lens[r] >= MAX_KV_LEN) Py_RETURN_NONE;  // an error, or past list_paths' bounds
    Options o;
    if (!read_options(args + 3, &o) || !truth_arg(args[9], &o.enable_split) || !truth_arg(args[10], &o.balance_tail) ||
        !read_min_waves(args[11], &o) || !resolve_sizes(&o, args[12], args[13], args[14], batch, qo[batch], longest_q))
        Py_RETURN_NONE;
    Target target;
    if (!target.open(args[2])) Py_RETURN_NONE;
    try {
        return plan_prefill(target, o, qo, lens, batch);
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
}

// ------------------------------------------------------------------------------------------------ decode

constexpr i64 MAX_DECODE_ITEMS = 1 << 20;  // a split past this many items: the Python path

// list_paths.plan_decode_lists after the intake and _sizes
PyObject* plan_decode(Target& target, const Options& o, const i64* qo, const i64* lens, i64 batch, i64 max_len,
                      i64 work) {
    i64 g = o.granularity;
    i64 kv_chunk = std::max(g, ceil_div(max_len, g) * g), n = batch;
    bool split = false;
    if (o.enable_split && max_len <= g) {
        kv_chunk = g;
    } else if (o.enable_split) {
        i64 chunk[9], counted[9];
        int count = split_candidates(max_len, work, o, chunk);
        for (int c = 0; c < count; ++c) {
            counted[c] = 0;
            for (i64 r = 0; r < batch; ++r) counted[c] += ceil_div(lens[r], chunk[c]);
        }
        int at = pick_chunk(chunk, counted, count, batch - counted[0], max_len, work, o, &n);
        if (at < 0) Py_RETURN_NONE;  // the capacity PlanError
        kv_chunk = chunk[at];
        split = n > batch;
    }
    if (n > MAX_DECODE_ITEMS) Py_RETURN_NONE;
    int32_t chunks[SMALL_DECODE];
    std::vector<Item> items;
    std::vector<Ramp> ramps;
    items.reserve(size_t(n));
    for (i64 r = 0; r < batch; ++r) {
        i64 x = lens[r], c = split ? std::max(ceil_div(x, kv_chunk), 1LL) : 1;  // an empty request has one chunk
        chunks[r] = int32_t(c);
        if (c == 1) {
            items.push_back({int32_t(r), 0, -1, 0, int32_t(x)});
            continue;
        }
        for (i64 j = 0; j < c; ++j)
            items.push_back({int32_t(r), 0, int32_t(j), int32_t(j * kv_chunk), int32_t(std::min((j + 1) * kv_chunk, x))});
        ramps.push_back({r, r + 1, c});
    }
    // longest first, ties in (request, chunk) order: list_paths._write_decode_rows, fast_paths.split_decode_items
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& a, const Item& b) { return a.start - a.end < b.start - b.end; });
    // the list path packs split items (zeroing the rows' alignment gaps) up to SMALL_ITEMS of them
    return write_plan(target, o, qo, lens, chunks, batch, batch, items, ramps, kv_chunk, split && n <= SMALL_ITEMS);
}

// decode(kv_lens, flat, num_qo_heads, num_kv_heads, tile_rows, kv_granularity, num_sms, item_overhead,
//        enable_split, max_batch_size, max_total_q, capacity): list_paths.plan_decode_lists
PyObject* decode(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "decode: takes 12 arguments, got %zd", nargs);
        return nullptr;
    }
    i64 lens[SMALL_DECODE], qo[SMALL_DECODE + 1], max_len = 0, work = 0;
    Py_ssize_t batch = 0;
    if (!read_ints(args[0], lens, SMALL_DECODE, 0, &batch, true)) Py_RETURN_NONE;
    qo[0] = 0;
    for (Py_ssize_t r = 0; r < batch; ++r) {
        if (lens[r] < 0 || lens[r] >= MAX_KV_LEN) Py_RETURN_NONE;  // the PlanError of plan_decode
        max_len = std::max(max_len, lens[r]), work += lens[r], qo[r + 1] = r + 1;
    }
    Options o;
    if (!read_options(args + 2, &o) || !truth_arg(args[8], &o.enable_split) ||
        !resolve_sizes(&o, args[9], args[10], args[11], batch, batch, -1))
        Py_RETURN_NONE;
    if (o.group_size > o.tile_rows) Py_RETURN_NONE;  // a GQA group past one tile: the numpy path
    Target target;
    if (!target.open(args[1])) Py_RETURN_NONE;
    try {
        return plan_decode(target, o, qo, lens, batch, max_len, work);
    } catch (const std::bad_alloc&) {
        return PyErr_NoMemory();
    }
}

// set_info_type(SplitKVInfo): the type of the info tuples the plans return (a tuple subclass without slots of
// its own, as a NamedTuple is)
PyObject* set_info_type(PyObject*, PyObject* type) {
    if (!PyType_Check(type) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), &PyTuple_Type) ||
        reinterpret_cast<PyTypeObject*>(type)->tp_basicsize != PyTuple_Type.tp_basicsize) {
        PyErr_SetString(PyExc_TypeError, "set_info_type: expected a NamedTuple class");
        return nullptr;
    }
    Py_INCREF(type);  // kept for the life of the process
    info_type = reinterpret_cast<PyTypeObject*>(type);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"prefill", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(prefill)), METH_FASTCALL,
     "The split-KV plan of a small prefill batch (list_paths.plan_lists), written into flat."},
    {"decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(decode)), METH_FASTCALL,
     "The split-KV plan of a small decode batch (list_paths.plan_decode_lists), written into flat."},
    {"set_info_type", set_info_type, METH_O, "Plans return their info as this tuple subclass (SplitKVInfo)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "flashgen_planner", "flashgen's native split-KV list paths.", -1,
                          methods, nullptr, nullptr, nullptr, nullptr};

PyTypeObject* type_of(const char* module, const char* name) {
    PyObject* mod = PyImport_ImportModule(module);
    if (mod == nullptr) return nullptr;
    PyObject* type = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    if (type != nullptr && !PyType_Check(type)) {
        Py_DECREF(type);
        PyErr_Format(PyExc_TypeError, "%s.%s is not a type", module, name);
        return nullptr;
    }
    return reinterpret_cast<PyTypeObject*>(type);  // kept for the life of the process
}

}  // namespace

PyMODINIT_FUNC PyInit_flashgen_planner() {
    ndarray_type = type_of("numpy", "ndarray");
    tensor_type = ndarray_type == nullptr ? nullptr : type_of("torch", "Tensor");
    if (tensor_type == nullptr) return nullptr;
    PyObject* module = PyModule_Create(&module_def);
    if (module == nullptr) return nullptr;
    const struct {
        const char* name;
        i64 value;
    } constants[] = {{"INT32_LIMIT", INT32_LIMIT}, {"MAX_KV_LEN", MAX_KV_LEN}, {"SMALL_BATCH", SMALL_BATCH},
                     {"SMALL_DECODE", SMALL_DECODE}, {"SMALL_ITEMS", SMALL_ITEMS},
                     {"SMALL_SPLIT_ITEMS", SMALL_SPLIT_ITEMS}, {"ALIGN", ALIGN}};
    for (const auto& c : constants) {
        if (PyModule_AddObject(module, c.name, PyLong_FromLongLong(c.value)) < 0) {
            Py_DECREF(module);
            return nullptr;
        }
    }
    if (PyModule_AddObject(module, "ALONE_SPEEDUP", PyFloat_FromDouble(ALONE_SPEEDUP)) < 0) {
        Py_DECREF(module);
        return nullptr;
    }
    return module;
}
