// Python binding of the native probe (ccld_plugin._native). Thin: every call forwards to
// the C library, which never calls back into Python.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

extern "C" {
#include "board.h"
}

namespace nb = nanobind;

namespace {

template <typename T>
T checked(nb::handle value, const std::string& name) {
  // Through 64-bit ints so that a value out of the field's range is an error, not a wrap.
  if constexpr (std::is_signed_v<T>) {
    int64_t v = nb::cast<int64_t>(value);
    if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max())
      throw std::invalid_argument("channel field " + name + " out of range");
    return static_cast<T>(v);
  } else {
    uint64_t v = nb::cast<uint64_t>(value);
    if (v > std::numeric_limits<T>::max())
      throw std::invalid_argument("channel field " + name + " out of range");
    return static_cast<T>(v);
  }
}

void set_channel_field(ccld_channel& c, const std::string& name, nb::handle v) {
#define CH(field)                                             \
  if (name == #field) {                                       \
    c.field = checked<decltype(c.field)>(v, name);            \
    return;                                                   \
  }
  if (name == "source") return;
  CH(direction) CH(wait) CH(channel_id) CH(peer) CH(pid) CH(group_id) CH(seq)
  CH(steps_posted) CH(steps_done) CH(bytes_done) CH(bytes_queued) CH(first_ns)
  CH(last_progress_ns) CH(rtt_us) CH(retrans) CH(rwnd_limited_us) CH(sndbuf_limited_us)
  CH(busy_us) CH(delivery_rate) CH(local_port) CH(remote_port) CH(remote_addr)
#undef CH
  throw std::invalid_argument("ccld_channel has no field " + name);
}

class Board {
 public:
  Board(const std::string& path, int32_t rank, int32_t world, const std::string& job,
        const std::string& host, uint32_t ring_size, uint32_t max_groups, uint32_t max_channels,
        uint32_t rank_pool_size) {
    b_ = ccld_board_create(path.c_str(), rank, world, job.c_str(), host.c_str(), ring_size,
                           max_groups, max_channels, rank_pool_size);
    if (!b_) {
      // An OSError with its errno: the session tells a full folder (ENOSPC) from the rest.
      PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
      throw nb::python_error();
    }
  }
  ~Board() { close(false); }

  int32_t register_group(uint64_t group_id, int32_t role, const std::vector<int32_t>& ranks,
                         int32_t my_index) {
    return ccld_group_register(live(), group_id, role, ranks.data(),
                               static_cast<int32_t>(ranks.size()), my_index);
  }
  void set_group_role(uint32_t slot, int32_t role) { ccld_group_set_role(live(), slot, role); }
  uint64_t enter(uint32_t slot, uint16_t op, uint8_t flags, uint64_t bytes) {
    return ccld_op_enter(live(), slot, op, flags, bytes, CCLD_NO_RANK, 0);
  }
  uint64_t enter_p2p(uint32_t slot, uint16_t op, uint8_t flags, uint64_t bytes, int32_t peer,
                     uint64_t seq) {
    return ccld_op_enter(live(), slot, op, flags, bytes, peer, seq);
  }
  void exit(uint64_t index, uint8_t state) { ccld_op_exit(live(), index, state); }
  void add_bytes(uint64_t index, uint64_t bytes) { ccld_op_add_bytes(live(), index, bytes); }
  void set_device(uint64_t index, uint8_t source, int64_t start_ns, int64_t end_ns,
                  uint32_t err_ns) {
    ccld_op_set_device(live(), index, source, start_ns, end_ns, err_ns);
  }
  void heartbeat() { ccld_heartbeat(live()); }
  void set_step(int64_t step) { ccld_set_step(live(), step); }
  void count_error() { ccld_count_error(live()); }
  void add_blocked(uint64_t ns) { ccld_add_blocked(live(), ns); }
  uint64_t blocked_ns() {
    return __atomic_load_n(&ccld_board_header(live())->blocked_ns, __ATOMIC_RELAXED);
  }
  void set_clock_offset(int64_t ns) { ccld_set_clock_offset(live(), ns); }

  int32_t channel_claim(uint8_t source) { return ccld_channel_claim(live(), source); }
  void channel_release(int32_t slot) { ccld_channel_release(live(), slot); }
  // Fill a channel record from keyword arguments named like the fields of ccld_channel
  // (unnamed fields are 0) and publish it with the record's seqlock. `source` is accepted
  // and ignored: the slot keeps the source that claimed it.
  void channel_write(int32_t slot, nb::kwargs fields) {
    ccld_channel rec;
    std::memset(&rec, 0, sizeof rec);
    for (auto [key, value] : fields) {
      set_channel_field(rec, nb::cast<std::string>(key), value);
    }
    ccld_channel_write(live(), slot, &rec);
  }

  bool closed() const { return b_ == nullptr; }
  void close(bool unlink_file) {
    if (b_) {
      ccld_board_close(b_, unlink_file ? 1 : 0);
      b_ = nullptr;
    }
  }

 private:
  ccld_board* live() {
    if (!b_) throw std::runtime_error("the board is closed");
    return b_;
  }
  ccld_board* b_ = nullptr;
};

using Field = std::tuple<std::string, size_t, std::string>;
using Layout = std::tuple<size_t, std::vector<Field>>;

#define F(T, name, dtype) Field{#name, offsetof(T, name), dtype}

// The board's enums by the names Python gives them (ccld_plugin.wire.codes holds the Python
// table; a native test checks that the two agree).
template <typename... E> nb::tuple ints(E... values) {
  return nb::make_tuple(static_cast<int>(values)...);
}

nb::dict codes() {
  nb::dict op;
  const std::pair<const char *, int> ops[] = {
      {"unknown", CCLD_OP_UNKNOWN},
      {"all_reduce", CCLD_OP_ALL_REDUCE},
      {"all_gather", CCLD_OP_ALL_GATHER},
      {"all_gather_into_tensor", CCLD_OP_ALL_GATHER_INTO_TENSOR},
      {"reduce_scatter", CCLD_OP_REDUCE_SCATTER},
      {"reduce_scatter_tensor", CCLD_OP_REDUCE_SCATTER_TENSOR},
      {"broadcast", CCLD_OP_BROADCAST},
      {"reduce", CCLD_OP_REDUCE},
      {"all_to_all", CCLD_OP_ALL_TO_ALL},
      {"all_to_all_single", CCLD_OP_ALL_TO_ALL_SINGLE},
      {"barrier", CCLD_OP_BARRIER},
      {"send", CCLD_OP_SEND},
      {"recv", CCLD_OP_RECV},
      {"isend", CCLD_OP_ISEND},
      {"irecv", CCLD_OP_IRECV},
      {"batch_isend_irecv", CCLD_OP_BATCH_P2P},
      {"coalesced", CCLD_OP_COALESCED},
      {"gather", CCLD_OP_GATHER},
      {"scatter", CCLD_OP_SCATTER},
      {"_all_gather_base", CCLD_OP_ALL_GATHER_BASE},
      {"_reduce_scatter_base", CCLD_OP_REDUCE_SCATTER_BASE},
      {"all_reduce_coalesced", CCLD_OP_ALL_REDUCE_COALESCED},
      {"all_gather_coalesced", CCLD_OP_ALL_GATHER_COALESCED},
      {"monitored_barrier", CCLD_OP_MONITORED_BARRIER},
      {"all_gather_single", CCLD_OP_ALL_GATHER_SINGLE},
      {"reduce_scatter_single", CCLD_OP_REDUCE_SCATTER_SINGLE},
  };
  for (const auto &[name, code] : ops) op[name] = code;
  nb::dict d;
  d["op"] = op;
  d["state"] = ints(CCLD_STATE_EMPTY, CCLD_STATE_IN_FLIGHT, CCLD_STATE_DONE,
                              CCLD_STATE_ERROR);
  d["flag"] = ints(CCLD_FLAG_ASYNC, CCLD_FLAG_P2P, CCLD_FLAG_SEND, CCLD_FLAG_CUDA,
                   CCLD_FLAG_DEVICE);
  d["time"] = ints(CCLD_TIME_NONE, CCLD_TIME_PROFILER, CCLD_TIME_EVENTS, CCLD_TIME_WORK,
                   CCLD_TIME_POLL);
  d["source"] = ints(CCLD_SRC_NONE, CCLD_SRC_NCCL, CCLD_SRC_TCP);
  d["direction"] = ints(CCLD_DIR_SEND, CCLD_DIR_RECV);
  d["wait"] = ints(CCLD_WAIT_NONE, CCLD_WAIT_LOCAL, CCLD_WAIT_PEER, CCLD_WAIT_NETWORK);
  d["channel_total"] = static_cast<int>(CCLD_CHANNEL_TOTAL);
  return d;
}

nb::dict layout() {
  nb::dict d;
  d["header"] = Layout{sizeof(ccld_header),
                       {F(ccld_header, magic, "<u8"), F(ccld_header, version, "<u4"),
                        F(ccld_header, header_size, "<u4"), F(ccld_header, file_size, "<u8"),
                        F(ccld_header, rank, "<i4"), F(ccld_header, world, "<i4"),
                        F(ccld_header, pid, "<i4"), F(ccld_header, ring_size, "<u4"),
                        F(ccld_header, max_groups, "<u4"), F(ccld_header, max_channels, "<u4"),
                        F(ccld_header, rank_pool_size, "<u4"),
                        F(ccld_header, groups_off, "<u4"), F(ccld_header, ring_off, "<u4"),
                        F(ccld_header, channels_off, "<u4"),
                        F(ccld_header, rank_pool_off, "<u4"),
                        F(ccld_header, start_wall_ns, "<i8"),
                        F(ccld_header, start_mono_ns, "<i8"), F(ccld_header, host, "S64"),
                        F(ccld_header, job, "S64"), F(ccld_header, num_groups, "<u8"),
                        F(ccld_header, rank_pool_used, "<u8"),
                        F(ccld_header, ops_written, "<u8"), F(ccld_header, heartbeat_ns, "<i8"),
                        F(ccld_header, step, "<i8"), F(ccld_header, step_start_ns, "<i8"),
                        F(ccld_header, errors, "<u8"), F(ccld_header, clock_offset_ns, "<i8"),
                        F(ccld_header, closed, "<u8"), F(ccld_header, blocked_ns, "<u8")}};
  d["group"] = Layout{sizeof(ccld_group),
                      {F(ccld_group, group_id, "<u8"), F(ccld_group, role, "<i4"),
                       F(ccld_group, size, "<i4"), F(ccld_group, ranks_off, "<u4"),
                       F(ccld_group, my_index, "<i4"), F(ccld_group, entered_seq, "<u8"),
                       F(ccld_group, completed_seq, "<u8"), F(ccld_group, last_enter_ns, "<i8"),
                       F(ccld_group, last_exit_ns, "<i8")}};
  d["op"] = Layout{sizeof(ccld_op_record),
                   {F(ccld_op_record, lock, "<u4"), F(ccld_op_record, op, "<u2"),
                    F(ccld_op_record, state, "u1"), F(ccld_op_record, flags, "u1"),
                    F(ccld_op_record, group_slot, "<u2"), F(ccld_op_record, dev_source, "u1"),
                    F(ccld_op_record, index_lo, "<u4"),
                    F(ccld_op_record, peer, "<i4"), F(ccld_op_record, step, "<i4"),
                    F(ccld_op_record, group_id, "<u8"), F(ccld_op_record, seq, "<u8"),
                    F(ccld_op_record, bytes, "<u8"), F(ccld_op_record, enter_ns, "<i8"),
                    F(ccld_op_record, exit_ns, "<i8"), F(ccld_op_record, dev_start_ns, "<i8"),
                    F(ccld_op_record, dev_end_ns, "<i8"), F(ccld_op_record, dev_err_ns, "<u4")}};
  d["channel"] = Layout{
      sizeof(ccld_channel),
      {F(ccld_channel, lock, "<u4"), F(ccld_channel, source, "u1"),
       F(ccld_channel, direction, "u1"), F(ccld_channel, wait, "u1"),
       F(ccld_channel, channel_id, "u1"), F(ccld_channel, peer, "<i4"),
       F(ccld_channel, pid, "<u4"), F(ccld_channel, group_id, "<u8"), F(ccld_channel, seq, "<u8"),
       F(ccld_channel, steps_posted, "<u8"), F(ccld_channel, steps_done, "<u8"),
       F(ccld_channel, bytes_done, "<u8"), F(ccld_channel, bytes_queued, "<u8"),
       F(ccld_channel, first_ns, "<i8"), F(ccld_channel, last_progress_ns, "<i8"),
       F(ccld_channel, rtt_us, "<u4"), F(ccld_channel, retrans, "<u4"),
       F(ccld_channel, rwnd_limited_us, "<u8"), F(ccld_channel, sndbuf_limited_us, "<u8"),
       F(ccld_channel, busy_us, "<u8"), F(ccld_channel, delivery_rate, "<u8"),
       F(ccld_channel, local_port, "<u2"), F(ccld_channel, remote_port, "<u2"),
       F(ccld_channel, remote_addr, "<u4")}};
  d["magic"] = CCLD_BOARD_MAGIC;
  d["version"] = CCLD_BOARD_VERSION;
  d["codes"] = codes();
  return d;
}

#undef F

using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Seqlock-consistent copy of records from a (possibly foreign, shared) mapping into a
// private buffer. Returns the number of records that were consistent.
uint32_t copy_records(ConstBytes src, Bytes dst, uint32_t record_size) {
  if (record_size < sizeof(uint32_t) || src.shape(0) != dst.shape(0) ||
      src.shape(0) % record_size != 0) {
    throw std::invalid_argument("copy_records: buffers must be equal whole records");
  }
  uint32_t count = static_cast<uint32_t>(src.shape(0) / record_size);
  uint32_t good;
  {
    nb::gil_scoped_release release;
    good = ccld_copy_records(src.data(), dst.data(), count, record_size);
  }
  return good;
}

nb::object current_trace() {
  uint64_t gid = 0, seq = 0, index = 0;
  if (!ccld_current_trace(&gid, &seq, &index)) return nb::none();
  return nb::make_tuple(gid, seq, index);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "Native probe of ccld_plugin: the per-rank board.";
  nb::class_<Board>(m, "Board")
      .def(nb::init<const std::string&, int32_t, int32_t, const std::string&, const std::string&,
                    uint32_t, uint32_t, uint32_t, uint32_t>(),
           nb::arg("path"), nb::arg("rank"), nb::arg("world"), nb::arg("job"), nb::arg("host"),
           nb::arg("ring_size"), nb::arg("max_groups"), nb::arg("max_channels"),
           nb::arg("rank_pool_size"))
      .def("register_group", &Board::register_group)
      .def("set_group_role", &Board::set_group_role)
      .def("enter", &Board::enter)
      .def("enter_p2p", &Board::enter_p2p)
      .def("exit", &Board::exit)
      .def("add_bytes", &Board::add_bytes)
      .def("set_device", &Board::set_device)
      .def("heartbeat", &Board::heartbeat)
      .def("set_step", &Board::set_step)
      .def("count_error", &Board::count_error)
      .def("add_blocked", &Board::add_blocked)
      .def_prop_ro("blocked_ns", &Board::blocked_ns)
      .def("set_clock_offset", &Board::set_clock_offset)
      .def("channel_claim", &Board::channel_claim)
      .def("channel_release", &Board::channel_release)
      .def("channel_write", &Board::channel_write)
      .def_prop_ro("closed", &Board::closed)
      .def("close", &Board::close, nb::arg("unlink") = false);
  m.def("layout", &layout);
  m.def("copy_records", &copy_records);
  m.def("current_trace", &current_trace);
  m.def("clear_current_trace", &ccld_clear_current_trace);
  m.def("now_ns", &ccld_now_ns);
  m.def("board_size", &ccld_board_size);
}
