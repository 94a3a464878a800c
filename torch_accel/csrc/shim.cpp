// torch_accel's C++ shim: only what torch accepts as C++ objects (docs/torch.md, "Why C++").
//
// Every decision is made in Python (torch_accel/_hooks.py): this file adapts torch's C++
// interfaces to calls of that module's functions, with the GIL taken for each. A Python
// exception raised there travels back as itself (torch's bindings restore
// py::error_already_set), so a device OOM is torch.OutOfMemoryError, a lost device the
// runtime's DeviceLostError (a RuntimeError) and a use after fork torch's "Cannot
// re-initialize accel in forked subprocess" RuntimeError. The calls torch makes from
// destructors and noexcept functions (deleters, guards putting the device or stream
// back, event destruction, deviceCount) print the exception instead (call_quietly):
// thrown there, it would abort the process.
//
//   * DeviceGuardImpl: current device, streams (ids: 0 the default stream, others made by
//     Python), events (handles are Python event ids), synchronisation, elapsed time.
//   * DeviceAllocator: storages are runtime caching-allocator blocks; the data pointer is
//     the block's device address, never dereferenced here.
//   * PrivateUse1HooksInterface: lazy init, primary contexts, generators, pinned memory.
//   * a Philox-style counter generator (seed, offset), read by the random kernels.
//   * the metadata-only tensor kernels (empty, views, set_, resize_): torch implements them
//     only in C++, per device.
//   * record_stream and CPU/accel shallow copies (``x.data = y``), which need the block or
//     the dispatch keys; autocast's fallthrough and casting lists.
//   * the attention backend choice F.scaled_dot_product_attention asks a DispatchStub for.
//   * for speed only, the launch plans' helpers (a key, a result, the buffers: plain CPython
//     functions, every planned operator calls them; they decide nothing), and the kernels
//     of add, sub, mul and div, which launch a call's plan themselves (Python makes the
//     plans and answers every other call).

#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceCapability.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/stubs/base.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <chrono>
#include <cstring>
#include <pthread.h>
#include <unistd.h>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using c10::DeviceIndex;
using c10::DeviceType;

namespace {

constexpr DeviceType kAccel = DeviceType::PrivateUse1;

// The Python module whose functions decide everything (set once by _register).
py::object* g_hooks = nullptr;

// Entering Python from a thread of torch's (an autograd device thread freeing a backward's
// tensors, say) while the interpreter exits is a crash: once Python has begun to finalise,
// a thread that waits for the GIL is ended with pthread_exit, whose unwinding through a
// destructor (a storage's deleter) is std::terminate, "terminate called without an active
// exception". So every entry is counted, and an atexit handler (quiesce, registered by
// _register; atexit runs before finalisation begins) closes the gate and, the GIL released,
// waits for the calls inside to return. After it, entries are refused: a deleter skips its
// Python part (the process is ending; its fds return everything), a call raises.
std::atomic<int> g_entries{0};
std::atomic<bool> g_exiting{false};

// One entry into Python: admitted unless the gate is closed. Sequentially consistent
// atomics: either quiesce sees this entry counted, or this entry sees the gate closed.
class Entry {
 public:
  Entry() : admitted_((g_entries.fetch_add(1), !g_exiting.load() && Py_IsInitialized())) {}
  ~Entry() { g_entries.fetch_sub(1); }
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;
  explicit operator bool() const { return admitted_; }

 private:
  bool admitted_;
};

// The atexit handler: close the gate, then let the calls already inside finish (bounded:
// a call that never returns must not hold the exit).
void quiesce() {
  g_exiting.store(true);
  py::gil_scoped_release released;
  for (int waited_ms = 0; g_entries.load() > 0 && waited_ms < 2000; ++waited_ms)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

template <typename R = py::object, typename... Args>
R call(const char* name, Args&&... args) {
  TORCH_CHECK(g_hooks != nullptr, "torch_accel is not initialised (import torch_accel)");
  Entry entry;
  TORCH_CHECK(entry, "torch_accel: the interpreter is exiting (", name, " refused)");
  py::gil_scoped_acquire gil;
  py::object out = g_hooks->attr(name)(std::forward<Args>(args)...);
  if constexpr (std::is_same_v<R, py::object>) {
    return out;
  } else if constexpr (std::is_same_v<R, void>) {
    return;
  } else {
    return out.cast<R>();
  }
}

// Calls from noexcept and destructor paths: an error is printed, never thrown (an
// exception leaving a destructor or a noexcept function is std::terminate, which kills
// the process). ``use`` reads the result under the GIL, if there is one.
// They run while Python unwinds too (a failed operator's temporary tensors are freed with
// its exception pending): the pending exception is set aside for the call and put back
// after, or the call would consume it and Python would see "error return without
// exception set".
template <typename Use, typename... Args>
void call_quietly_with(const char* name, Use&& use, Args&&... args) noexcept {
  if (g_hooks == nullptr) return;
  Entry entry;
  if (!entry) return;
  py::gil_scoped_acquire gil;
  py::error_scope pending;
  try {
    use(g_hooks->attr(name)(std::forward<Args>(args)...));
  } catch (py::error_already_set& e) {
    e.discard_as_unraisable(name);
  } catch (...) {
  }
}

template <typename... Args>
void call_quietly(const char* name, Args&&... args) noexcept {
  call_quietly_with(name, [](const py::object&) {}, std::forward<Args>(args)...);
}

c10::Device accel(DeviceIndex index) { return c10::Device(kAccel, index); }

// ------------------------------------------------------- current device and streams
// The autograd engine asks the guard for the current device and stream, and exchanges
// them, around every backward function (~100 calls a training step of a small MLP, each
// an entry into Python: ~5% of the step's host CPU). The answers are the runtime's
// per-thread state, which changes only by this thread's own calls (set_device,
// set_stream and their context managers), and each such change bumps the runtime's
// epoch word (runtime.devices.current_epoch). So each thread keeps the answers it got
// from Python with the epoch they were read at, and answers from them while the word
// still reads that epoch, without the GIL. A change behind torch's back (a program's
// runtime.set_stream) bumps the word, and the next call asks Python again. A forked
// child's calls always reach Python, whose fork check raises there (g_fork_gen).
const uint64_t* g_epoch = nullptr;  // the runtime's word (set once by _register)
std::atomic<uint64_t> g_fork_gen{0};

constexpr int kCachedDevices = 64;

struct CurrentCache {
  uint64_t epoch = 0;
  uint64_t fork_gen = ~uint64_t{0};  // never a real generation: the first use refreshes
  int device = -1;                   // -1: not known
  int64_t stream[kCachedDevices];    // per device, the current stream's id; -1: not known

  // Forget the entries if the runtime's state may have changed since they were read;
  // returns whether the word can be read at all (before _register: no caching).
  bool refresh() {
    if (g_epoch == nullptr) return false;
    uint64_t now = __atomic_load_n(g_epoch, __ATOMIC_ACQUIRE);
    uint64_t gen = g_fork_gen.load(std::memory_order_relaxed);
    if (now != epoch || gen != fork_gen) {
      epoch = now;
      fork_gen = gen;
      device = -1;
      std::fill(std::begin(stream), std::end(stream), int64_t{-1});
    }
    return true;
  }
  static bool cacheable(DeviceIndex d) { return d >= 0 && d < kCachedDevices; }
  // Whether ``d`` is known to be the current device already (nothing to set or exchange).
  bool device_is(DeviceIndex d) { return refresh() && device >= 0 && device == d; }
};

thread_local CurrentCache t_current;

void learn_device(DeviceIndex index) {
  if (t_current.refresh()) t_current.device = index;
}

void learn_stream(DeviceIndex device, int64_t id) {
  if (t_current.refresh() && CurrentCache::cacheable(device)) t_current.stream[device] = id;
}

// The guard's getDevice, and the device a plain allocation lands on.
DeviceIndex current_device_index() {
  if (t_current.refresh() && t_current.device >= 0) return t_current.device;
  auto index = call<DeviceIndex>("current_device");
  learn_device(index);
  return index;
}

// --------------------------------------------------------------------- device guard
struct AccelGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = kAccel;

  DeviceType type() const override { return kAccel; }

  // The device and stream answers go through t_current (see CurrentCache): a call whose
  // answer is known returns it; any other asks Python, then records what it learnt, at
  // the epoch read after the call (the call's own change bumped it).
  c10::Device exchangeDevice(c10::Device d) const override {
    if (t_current.device_is(d.index())) return d;
    auto prev = call<DeviceIndex>("exchange_device", d.index());
    learn_device(d.index() >= 0 ? d.index() : prev);
    return accel(prev);
  }
  c10::Device getDevice() const override { return accel(current_device_index()); }
  void setDevice(c10::Device d) const override {
    if (t_current.device_is(d.index())) return;
    call<void>("set_device", d.index());
    if (d.index() >= 0) learn_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (t_current.device_is(d.index())) return;
    call_quietly_with("set_device", [&](const py::object&) {
      if (d.index() >= 0) learn_device(d.index());
    }, d.index());
  }

  // torch passes "accel" without an index for the current device
  c10::Device resolved(c10::Device d) const { return d.has_index() ? d : getDevice(); }
  c10::Stream stream_of(c10::Device d, int64_t id) const {
    return c10::Stream(c10::Stream::UNSAFE, resolved(d), id);
  }
  c10::Stream getStream(c10::Device d) const override {
    auto index = resolved(d).index();
    if (t_current.refresh() && CurrentCache::cacheable(index) && t_current.stream[index] >= 0)
      return stream_of(d, t_current.stream[index]);
    auto id = call<int64_t>("current_stream", index);
    learn_stream(index, id);
    return stream_of(d, id);
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream_of(d, 0); }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    return stream_of(d, call<int64_t>("new_stream", resolved(d).index(), priority));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return stream_of(d, call<int64_t>("new_stream", resolved(d).index(), high_priority ? -1 : 0));
  }
  // Stream guards call this from their destructors too (c10::StreamGuard, the autograd
  // engine's around each backward function), to put the previous stream back: there a
  // failure (the device was lost meanwhile) must not terminate the process, so it is
  // printed, and the guard is told the default stream was current. The device's next
  // use raises the loss where it can be caught.
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto index = s.device_index();
    if (t_current.refresh() && CurrentCache::cacheable(index) && t_current.stream[index] >= 0
        && t_current.stream[index] == s.id())
      return s;  // already current: nothing to set, and it was the previous one
    int64_t prev = 0;
    call_quietly_with("exchange_stream", [&](const py::object& out) {
      prev = out.cast<int64_t>();
      learn_stream(index, s.id());
    }, index, s.id());
    return stream_of(s.device(), prev);
  }
  bool queryStream(const c10::Stream& s) const override {
    return call<bool>("stream_query", s.device_index(), s.id());
  }
  void synchronizeStream(const c10::Stream& s) const override {
    call<void>("stream_synchronize", s.device_index(), s.id());
  }
  void synchronizeDevice(const DeviceIndex index) const override {
    call<void>("synchronize", index);
  }

  // Event handles are Python event ids (never 0) stored in the void*.
  void record(void** event, const c10::Stream& s, const DeviceIndex index,
              const c10::EventFlag flag) const override {
    auto id = call<int64_t>("event_record", reinterpret_cast<intptr_t>(*event), index,
                            s.device_index(), s.id(), flag == c10::EventFlag::BACKEND_DEFAULT);
    *event = reinterpret_cast<void*>(id);
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event) call<void>("event_block", reinterpret_cast<intptr_t>(event), s.device_index(), s.id());
  }
  bool queryEvent(void* event) const override {
    return !event || call<bool>("event_query", reinterpret_cast<intptr_t>(event));
  }
  void synchronizeEvent(void* event) const override {
    if (event) call<void>("event_synchronize", reinterpret_cast<intptr_t>(event));
  }
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    return call<double>("event_elapsed", reinterpret_cast<intptr_t>(start),
                        reinterpret_cast<intptr_t>(end));
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    if (event) call_quietly("event_destroy", reinterpret_cast<intptr_t>(event));
  }
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const override;

  // Every dtype allocates and copies (the kernels' types natively, the others as bits
  // or through the host), complex ones too, except the quantized ones: a quantized
  // tensor is a QTensorImpl that only a QuantizedPrivateUse1 kernel makes, and there is
  // no quantized kernel to use it with (torch deprecates these dtypes).
  c10::DeviceCapability getDeviceCapability(c10::Device) const override {
    c10::DeviceCapability cap;
    auto& t = cap.capability_data.supported_scalar_types;
    t.has_QInt8 = t.has_QUInt8 = t.has_QInt32 = t.has_QUInt4x2 = t.has_QUInt2x4 = 0;
    return cap;
  }

  DeviceIndex deviceCount() const noexcept override {
    DeviceIndex n = 0;
    call_quietly_with("device_count", [&](const py::object& out) { n = out.cast<DeviceIndex>(); });
    return n;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, AccelGuardImpl);

// ------------------------------------------------------------------------ allocator
// A storage's context: the block's device address and device (addresses of different
// devices may coincide, so the address alone does not name the block), and the runtime
// array the hooks keep for it in ``blocks`` (a strong reference, dropped after ``free``),
// so that a launch plan finds its buffers without a lookup (``_buffers``).
struct Block {
  intptr_t va;
  DeviceIndex device;
  PyObject* array;
  pid_t pid;  // the process that allocated it: a forked child's copy frees nothing
};

// This process's pid, refreshed in a forked child (pthread_atfork): the free path compares
// it with a block's without a system call.
pid_t g_pid = getpid();

// The storage hot path: every tensor's allocation calls this function of the hooks module,
// so it is looked up once (by _register) and called through CPython's vectorcall with its
// two integers, not pybind11's per-call name lookup, argument tuple and casts
// (docs/torch.md, "The small op's host path, third pass"). A free needs no Python function
// of its own: it takes the block's entry out of the hooks' ``blocks`` table here and drops
// the array's reference, whose finaliser gives the block back to the caching allocator.
PyObject* g_alloc_fn = nullptr;  // _hooks.alloc(nbytes, device) -> its runtime array
PyObject* g_blocks = nullptr;    // _hooks.blocks: (device, va) -> runtime array
PyObject* g_va = nullptr;        // "va", interned

// f(a, b): a new reference, or nullptr with the Python error set. The GIL is held.
PyObject* call_ints(PyObject* f, long long a, long long b) {
  PyObject* args[2] = {PyLong_FromLongLong(a), PyLong_FromLongLong(b)};
  PyObject* out = args[0] && args[1] ? PyObject_Vectorcall(f, args, 2, nullptr) : nullptr;
  Py_XDECREF(args[0]);
  Py_XDECREF(args[1]);
  return out;
}

// A storage's deleter: a destructor's path, so an error is printed, never thrown, and a
// Python exception pending meanwhile is set aside (call_quietly_with's rules). In a child
// forked after the block was allocated the table keeps its entry, so the array is never
// freed there (its memory is the parent's).
void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  Entry entry;
  if (g_blocks != nullptr && entry) {
    py::gil_scoped_acquire gil;
    py::error_scope pending;
    if (b->pid == g_pid) {
      PyObject* key = Py_BuildValue("(in)", static_cast<int>(b->device),
                                    static_cast<Py_ssize_t>(b->va));
      if (key == nullptr || (PyDict_DelItem(g_blocks, key) < 0 &&
                             !PyErr_ExceptionMatches(PyExc_KeyError)))
        py::error_already_set().discard_as_unraisable("free");
      PyErr_Clear();  // a KeyError: the entry went already (as ``blocks.pop(key, None)``)
      Py_XDECREF(key);
    }
    Py_DECREF(b->array);  // the array's last reference, unless a forked child kept it
    if (PyErr_Occurred()) py::error_already_set().discard_as_unraisable("free");
  }
  delete b;
}

struct AccelAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    return allocate_on(nbytes, current_device_index());
  }
  // A block of ``device`` (checked: an index out of range is torch's RuntimeError).
  c10::DataPtr allocate_on(size_t nbytes, DeviceIndex device) const {
    if (nbytes == 0) {
      call<void>("checked", device);
      return c10::DataPtr(nullptr, accel(device));
    }
    TORCH_CHECK(g_alloc_fn != nullptr, "torch_accel is not initialised (import torch_accel)");
    Block* block;
    {
      Entry entry;
      TORCH_CHECK(entry, "torch_accel: the interpreter is exiting (alloc refused)");
      py::gil_scoped_acquire gil;
      py::object array = py::reinterpret_steal<py::object>(
          call_ints(g_alloc_fn, static_cast<long long>(nbytes), device));
      if (!array) throw py::error_already_set();
      auto va = py::reinterpret_steal<py::object>(PyObject_GetAttr(array.ptr(), g_va));
      if (!va) throw py::error_already_set();
      block = new Block{static_cast<intptr_t>(PyLong_AsSsize_t(va.ptr())), device,
                        array.release().ptr(), g_pid};
    }
    intptr_t va = block->va;
    return c10::DataPtr(reinterpret_cast<void*>(va), block, &free_block, accel(device));
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    copy_on(call<DeviceIndex>("current_device"), dest, src, count);
  }
  void copy_on(DeviceIndex device, void* dest, const void* src, std::size_t count) const {
    call<void>("copy_data", device, reinterpret_cast<intptr_t>(dest),
               reinterpret_cast<intptr_t>(src), count);
  }

  bool initialized() override { return call<bool>("is_initialized"); }
  void emptyCache(c10::MempoolId_t) override { call<void>("empty_cache"); }
  void recordStream(const c10::DataPtr& p, c10::Stream s) override {
    auto* block = static_cast<Block*>(p.get_context());
    if (block && p.get_deleter() == &free_block)
      call<void>("record_stream", block->device, block->va, s.id());
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    auto stats = call<py::dict>("memory_stats", device);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto fill = [&](c10::CachingAllocator::StatArray& arr, const char* name) {
      const char* pools[] = {"all", "small_pool", "large_pool"};
      for (size_t i = 0; i < arr.size(); ++i) {
        std::string base = std::string(name) + "." + pools[i] + ".";
        arr[i].current = stats[py::str(base + "current")].cast<int64_t>();
        arr[i].peak = stats[py::str(base + "peak")].cast<int64_t>();
        arr[i].allocated = stats[py::str(base + "allocated")].cast<int64_t>();
        arr[i].freed = stats[py::str(base + "freed")].cast<int64_t>();
      }
    };
    fill(out.allocation, "allocation");
    fill(out.segment, "segment");
    fill(out.active, "active");
    fill(out.inactive_split, "inactive_split");
    fill(out.allocated_bytes, "allocated_bytes");
    fill(out.reserved_bytes, "reserved_bytes");
    fill(out.active_bytes, "active_bytes");
    fill(out.inactive_split_bytes, "inactive_split_bytes");
    fill(out.requested_bytes, "requested_bytes");
    out.num_alloc_retries = stats["num_alloc_retries"].cast<int64_t>();
    out.num_ooms = stats["num_ooms"].cast<int64_t>();
    out.num_sync_all_streams = stats["num_sync_all_streams"].cast<int64_t>();
    out.num_device_alloc = stats["num_device_alloc"].cast<int64_t>();
    out.num_device_free = stats["num_device_free"].cast<int64_t>();
    out.max_split_size = stats["max_split_size"].cast<int64_t>();
    return out;
  }
  void resetAccumulatedStats(DeviceIndex device) override {
    call<void>("reset_accumulated_memory_stats", device);
  }
  void resetPeakStats(DeviceIndex device) override {
    call<void>("reset_peak_memory_stats", device);
  }
  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    return call<std::pair<size_t, size_t>>("mem_get_info", device);
  }
};

AccelAllocator g_allocator;

// The allocator of one device, which ``empty`` and ``empty_strided`` hand torch: a tensor
// made for accel:i allocates on i without making i the current device around the call.
// A device guard there cost three calls into Python (exchange, restore and the
// allocator's question for the current device), ~3 us of a small operator's host time
// (docs/torch.md, "Where an eager op's time goes"). Storages keep it as their allocator.
struct DeviceBoundAllocator final : c10::Allocator {
  DeviceIndex device = 0;
  c10::DataPtr allocate(size_t nbytes) override { return g_allocator.allocate_on(nbytes, device); }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    g_allocator.copy_on(device, dest, src, count);
  }
};

c10::Allocator* allocator_of(DeviceIndex device) {
  static DeviceBoundAllocator bound[std::numeric_limits<DeviceIndex>::max() + 1];
  static std::once_flag numbered;
  std::call_once(numbered, [] {
    for (int i = 0; i <= std::numeric_limits<DeviceIndex>::max(); ++i) bound[i].device = i;
  });
  TORCH_CHECK(device >= 0, "accel: invalid device index ", static_cast<int>(device));
  return &bound[device];
}

// The device a factory's ``device`` argument names (none, or no index: the current one).
DeviceIndex device_of(const std::optional<c10::Device>& device) {
  return device && device->has_index() ? device->index() : call<DeviceIndex>("current_device");
}

void AccelGuardImpl::recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& s) const {
  g_allocator.recordStream(p, s);
}

// Pinned host memory: the runtime's pinned class (a sealed memfd the copy engines reach).
void free_pinned(void* ptr) { call_quietly("pinned_free", reinterpret_cast<intptr_t>(ptr)); }

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(DeviceType::CPU));
    auto ptr = reinterpret_cast<void*>(call<intptr_t>("pinned_alloc", nbytes));
    return c10::DataPtr(ptr, ptr, &free_pinned, c10::Device(DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator g_pinned;

// Storage growth (resize_, storage.resize_): a new block, the old bytes copied over on
// the device, the old block freed once the copy's stream is done with it.
void resize_storage(const c10::Storage& storage, size_t newsize) {
  auto* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
  c10::DeviceGuard guard(storage.device());
  c10::DataPtr fresh = g_allocator.allocate(newsize);
  size_t keep = std::min(newsize, impl->nbytes());
  if (keep && storage.data_ptr().get())
    g_allocator.copy_data(fresh.get(), storage.data_ptr().get(), keep);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

// ------------------------------------------------------------------------ generator
// Counter-based: a draw of n numbers reads (seed, offset) and moves offset past them, so
// a kernel's numbers depend only on the seed, the offset and the element index.
struct AccelGenerator final : c10::GeneratorImpl {
  explicit AccelGenerator(DeviceIndex index)
      : c10::GeneratorImpl(accel(index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override { seed_ = seed; offset_ = 0; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    auto s = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(s);
    return s;
  }
  // The state is 16 bytes, seed then offset (little-endian u64s), in a CPU uint8 tensor.
  void set_state(const c10::TensorImpl& state) override {
    TORCH_CHECK(state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && state.numel() == 16 &&
                    state.device().is_cpu(),
                "RNG state must be a CPU torch.ByteTensor of 16 bytes, got ", state.numel(),
                " elements of ", state.dtype().name());
    std::memcpy(&seed_, state.data(), 8);
    std::memcpy(&offset_, static_cast<const char*>(state.data()) + 8, 8);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    auto t = at::detail::empty_cpu({16}, at::kByte, std::nullopt, std::nullopt, std::nullopt,
                                   std::nullopt);
    std::memcpy(t.data_ptr(), &seed_, 8);
    std::memcpy(static_cast<char*>(t.data_ptr()) + 8, &offset_, 8);
    return t.getIntrusivePtr();
  }
  std::pair<uint64_t, uint64_t> take(uint64_t increment) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto out = std::make_pair(seed_, offset_);
    offset_ += increment;
    return out;
  }
  static DeviceType device_type() { return kAccel; }

 private:
  AccelGenerator* clone_impl() const override {
    auto* g = new AccelGenerator(device().index());
    g->seed_ = seed_;
    g->offset_ = offset_;
    return g;
  }
  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

// ---------------------------------------------------------------------------- hooks
struct AccelHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return call<bool>("is_available"); }
  void init() const override { call<void>("lazy_init"); }
  bool hasPrimaryContext(DeviceIndex index) const override {
    return call<bool>("has_primary_context", index);
  }
  DeviceIndex deviceCount() const override { return call<DeviceIndex>("device_count"); }
  void setCurrentDevice(DeviceIndex index) const override { call<void>("set_device", index); }
  DeviceIndex getCurrentDevice() const override { return call<DeviceIndex>("current_device"); }
  DeviceIndex exchangeDevice(DeviceIndex index) const override {
    return call<DeviceIndex>("exchange_device", index);
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  at::Device getDeviceFromPtr(void*) const override {
    // device addresses of different devices may coincide: only the storage knows
    TORCH_CHECK(false, "accel: a bare device pointer does not name its device");
  }
  bool isPinnedPtr(const void* data) const override {
    return call<bool>("is_pinned", reinterpret_cast<intptr_t>(data));
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned; }

  const at::Generator& getDefaultGenerator(DeviceIndex index) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (index < 0) index = call<DeviceIndex>("current_device");
    if (generators_.empty()) generators_.resize(call<DeviceIndex>("device_count"));
    TORCH_CHECK(index < static_cast<DeviceIndex>(generators_.size()), "accel: invalid device ",
                index, " (", generators_.size(), " visible)");
    auto& g = generators_[index];
    if (!g.defined()) g = at::make_generator<AccelGenerator>(index);
    return g;
  }
  at::Generator getNewGenerator(DeviceIndex index) const override {
    if (index < 0) index = call<DeviceIndex>("current_device");
    return at::make_generator<AccelGenerator>(index);
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage(storage, newsize);
  }

 private:
  mutable std::mutex mutex_;
  mutable std::vector<at::Generator> generators_;
};

// -------------------------------------------------------------- metadata-only kernels
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device,
                               std::optional<bool>, std::optional<c10::MemoryFormat> format) {
  return at::detail::empty_generic(size, allocator_of(device_of(device)),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
                         std::optional<c10::Device> device, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, allocator_of(device_of(device)),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, source, offset, size, stride);
  self.unsafeGetTensorImpl()->set_storage_offset(offset);
  at::OptionalIntArrayRef strides =
      stride.data() ? at::OptionalIntArrayRef(stride) : std::nullopt;
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, strides, /*resize_storage=*/false);
  at::native::checkInBoundsForStorage(size, self.strides(), offset, self.dtype(), self.storage());
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_source_storage_offset(self, std::move(source), 0, {numel}, {});
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef sym_size,
                         std::optional<c10::MemoryFormat> format) {
  auto size = C10_AS_INTARRAYREF_SLOW(sym_size);
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = c10::multiply_integers(size);
  size_t needed = numel == 0 ? 0
      : static_cast<size_t>(impl->storage_offset() + numel) * self.dtype().itemsize();
  if (needed > self.storage().nbytes()) resize_storage(self.storage(), needed);
  at::native::resize_impl_cpu_(impl, size, std::nullopt, /*resize_storage=*/false);
  if (format.has_value() && *format != c10::MemoryFormat::Preserve)
    impl->empty_tensor_restride(*format);
  return self;
}

// Tensor.record_stream: the storage's block is not handed out again after it is freed
// until the work queued on ``s`` so far is done (the CPU fallback cannot do this: the
// block lives on the device).
void record_stream(at::Tensor& self, c10::Stream s) {
  TORCH_CHECK(s.device() == self.device(), "record_stream: the stream is on ", s.device(),
              " but the tensor is on ", self.device());
  g_allocator.recordStream(self.storage().data_ptr(), s);
}

// torch.cuda's rule: CPU and device dense tensors may take each other's data
// (``cpu_tensor.data = accel_tensor``); TensorImpl's built-in list omits PrivateUse1.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.is_cpu() || t.device().type() == kAccel);
  };
  return self.key_set() == from.key_set() || (dense(self) && dense(from));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("record_stream", record_stream);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("resize_", resize);
}

// Autocast (torch.autocast(device_type="accel")): torch registers nothing for the
// AutocastPrivateUse1 key, not even the fallthrough, so without these every operator run
// under autocast fails. Every operator passes through except those below, from torch.cuda's
// lists (dot as OpenReg does): matrix products in the autocast dtype (the matrix unit's
// fast path), reductions and losses in float32.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(dot, fp32)
  KERNEL_PRIVATEUSEONE(mse_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(log_softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(cumsum, fp32)
}

// ----------------------------------------------------------------- attention
// F.scaled_dot_product_attention picks its backend through a DispatchStub, not the
// dispatcher (_fused_sdp_choice_stub), and a device without an entry there gets the math
// decomposition. This entry asks the dispatcher's _fused_sdp_choice, whose accel kernel
// decides in Python (ops/attention.py), as torch.ops.aten._fused_sdp_choice answers.
// (registered for the device at the end of this file, in torch's namespace)
int64_t fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& attn_mask, double dropout_p,
                         bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return at::_fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa);
}

// ----------------------------------------------------------------- profiler stubs
// torch.autograd.profiler.profile(use_device="accel") (the KINETO_PRIVATEUSE1_FALLBACK
// state) asks these for an event at each operator's start and end, and for the device
// time between them (key_averages' device columns). Without them every operator's
// profiler callback raised "PrivateUse1 used in profiler but not enabled" and
// key_averages() read unset start times (-7.4e16 us). Events are runtime timing events
// on the current stream, under the ids the guard's events use.
using torch::profiler::impl::ProfilerVoidEventStub;

struct AccelProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(DeviceIndex* device, ProfilerVoidEventStub* event, int64_t* cpu_ns) const override {
    auto [index, id] = call<std::pair<DeviceIndex, int64_t>>("profiler_record");
    if (device) *device = index;
    *event = ProfilerVoidEventStub(reinterpret_cast<void*>(id), [](void* e) {
      call_quietly("event_destroy", reinterpret_cast<intptr_t>(e));
    });
    if (cpu_ns) *cpu_ns = c10::getTime();
  }
  float elapsed(const ProfilerVoidEventStub* start, const ProfilerVoidEventStub* end) const override {
    return call<float>("profiler_elapsed_us", reinterpret_cast<intptr_t>(start->get()),
                       reinterpret_cast<intptr_t>(end->get()));
  }
  void mark(const char*) const override {}
  void rangePush(const char*) const override {}
  void rangePop() const override {}
  bool enabled() const override { return true; }
  void onEachDevice(std::function<void(int)> op) const override {
    auto prev = call<DeviceIndex>("current_device");
    for (DeviceIndex i = 0; i < call<DeviceIndex>("device_count"); ++i) {
      call<void>("set_device", i);
      op(i);
    }
    call<void>("set_device", prev);
  }
  void synchronize() const override { call<void>("synchronize", -1); }
};

AccelProfilerStubs g_profiler_stubs;

// ------------------------------------------------------------ launch plans' helpers
// Called on every planned operator (ops/_plans.py), so plain CPython functions: pybind11's
// overload dispatch and casts cost more than their work (docs/torch.md, "Where an eager
// op's time goes").

// _signature(*tensors): bytes naming each tensor's device, dtype, sizes and strides, a
// launch plan's key; None if an argument is not a tensor (a subclass included: it takes
// the checked path) or has no strides.
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t n) {
  std::string key;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!THPVariable_CheckExact(args[i])) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(args[i]);
      if (t.layout() != c10::kStrided) Py_RETURN_NONE;
      auto sizes = t.sizes();
      auto strides = t.strides();
      int64_t head[3] = {static_cast<int64_t>(t.device().type()), t.device().index(),
                         static_cast<int64_t>(t.scalar_type()) << 32 | t.dim()};
      key.append(reinterpret_cast<const char*>(head), sizeof head);
      key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
      key.append(reinterpret_cast<const char*>(strides.data()),
                 strides.size() * sizeof(int64_t));
    }
  } catch (const c10::Error&) {
    Py_RETURN_NONE;  // symbolic sizes, say: no plan
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

// (a tensor's storage's runtime array, its first element's byte offset there), a new
// reference; nullptr with no error set if the storage is not an allocator block (a DLPack
// import, no bytes), with one set if Python failed. The GIL is held; a tensor without
// storage throws c10::Error.
PyObject* buffer_of(const at::Tensor& t) {
  const auto& p = t.storage().data_ptr();
  auto* block = static_cast<Block*>(p.get_context());
  if (p.get_deleter() != &free_block || block == nullptr) return nullptr;
  PyObject* offset =
      PyLong_FromLongLong(t.storage_offset() * static_cast<int64_t>(t.element_size()));
  PyObject* pair = offset ? PyTuple_Pack(2, block->array, offset) : nullptr;
  Py_XDECREF(offset);
  return pair;
}

// _buffers(tensors): per tensor, (its storage's runtime array, its first element's byte
// offset there): a launch plan's buffers in one call; None if a storage is not an
// allocator block (a DLPack import, no bytes), which ops/_tensors.py resolves.
PyObject* buffers(PyObject*, PyObject* seq) {
  PyObject* fast = PySequence_Fast(seq, "_buffers takes a sequence of tensors");
  if (fast == nullptr) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  PyObject* out = PyTuple_New(n);
  try {
    for (Py_ssize_t i = 0; out != nullptr && i < n; ++i) {
      int is_tensor = THPVariable_CheckExact(items[i]) ? 1
          : THPVariableClass ? PyObject_IsInstance(items[i], THPVariableClass) : 0;
      if (is_tensor <= 0) {
        if (is_tensor == 0) PyErr_SetString(PyExc_TypeError, "_buffers takes tensors");
        Py_CLEAR(out);
        break;
      }
      PyObject* pair = buffer_of(THPVariable_Unpack(items[i]));
      if (pair == nullptr) {
        Py_CLEAR(out);
        if (PyErr_Occurred()) break;
        Py_DECREF(fast);
        Py_RETURN_NONE;
      }
      PyTuple_SET_ITEM(out, i, pair);
    }
  } catch (const c10::Error& e) {  // a tensor without storage
    Py_XDECREF(out);
    Py_DECREF(fast);
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  }
  Py_DECREF(fast);
  return out;
}

// _empty_like(t): a new tensor of an accel tensor's sizes and dtype on its device, laid
// out contiguous: what ``torch.empty_like`` of a contiguous ``t`` makes, through the same
// kernel (``empty.memory_format`` below) without the dispatcher's two passes (empty_like,
// then empty) and its argument parsing.
PyObject* empty_like(PyObject*, PyObject* arg) {
  if (!THPVariable_CheckExact(arg)) {
    PyErr_SetString(PyExc_TypeError, "_empty_like takes a tensor");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(arg);
  try {
    TORCH_CHECK(t.device().type() == kAccel, "_empty_like: a tensor on ", t.device());
    return THPVariable_Wrap(empty_memory_format(t.sizes(), t.scalar_type(), std::nullopt,
                                                t.device(), std::nullopt,
                                                c10::MemoryFormat::Contiguous));
  } catch (py::error_already_set& e) {  // the allocation's own error (OutOfMemoryError)
    e.restore();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// ------------------------------------------------------------ hot arithmetic in C++
// add, sub, mul and div (Tensor and Scalar overloads, functional and in place) are the
// eager operators a training step and ``a + b`` call most, so their accel kernels are
// here: a call whose kind has a launch plan runs no Python kernel. torch's dispatch into
// a Python kernel (its arguments boxed, a Python call) and that kernel's frames, key and
// table lookup were ~6 of the op's ~11 us of host time (docs/torch.md, "Where an eager
// op's time goes"). A call that can have a plan (a contiguous non-empty accel ``self``;
// ``other`` a contiguous tensor of the same device, dtype and sizes, or a number; a
// number ``alpha``) is keyed here on what its plan depends on. The first call of a key
// asks Python for the plan (ops/elementwise.py ``hot_plan``: the Python kernel's own
// table and maker); later ones allocate the result and call the plan's runtime
// LaunchPlan with the buffers, one call into Python. Every other call, and every call
// of a kind without a plan, goes to the Python kernel registered with the shim for its
// overload, which decides as before (promotion, broadcasting, mixed devices, the CPU
// fallback, torch's errors).
//
// The copies are forgotten whenever Python's table may have changed under them: at a new
// value of its epoch word (ops/_plans.py ``epoch``: a device's plans went with a reset or
// a lost context), or after a fork (the child's first call asks Python, whose fork check
// raises there). The map is touched only with the GIL held.

constexpr int kHotOps = 4;             // op indices: the order of ops/elementwise.py HOT
constexpr int kHotForms = 4;           // Tensor, Scalar, in-place Tensor, in-place Scalar
constexpr size_t kMaxHotPlans = 1024;  // as ops/_plans.py MAX_PLANS

struct HotOp {
  PyObject* kernel[kHotForms] = {};  // each form's Python kernel (every call not planned)
  bool alpha = false;                // its overloads take alpha (add, sub)
};
HotOp g_hot[kHotOps];
PyObject* g_hot_plan = nullptr;          // hot_plan(op, self, other, alpha, in_place)
const uint64_t* g_plan_epoch = nullptr;  // ops/_plans.py's epoch word
PyObject* g_sanitizer = nullptr;         // runtime.sanitizer's namespace (its ``active``)
PyObject* g_active = nullptr;            // "active", interned

// Whether the runtime's sanitizer is on (the GIL is held): it names a launch's aten
// operator from the Python kernel's frame, so while it is on every call takes that.
bool sanitizing() {
  PyObject* active = PyDict_GetItemWithError(g_sanitizer, g_active);  // borrowed
  if (active == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return active != nullptr && active != Py_None;
}

struct HotPlan {
  PyObject* launch = nullptr;  // the runtime LaunchPlan; nullptr: this kind has no plan
  int8_t sources[3] = {};      // per buffer parameter: -1 the result, 0 self, 1 other
  int n = 0;
};

struct HotPlans {
  uint64_t epoch = 0;
  uint64_t fork_gen = 0;
  std::unordered_map<std::string, HotPlan> plans;

  void clear() {
    for (auto& kv : plans) Py_XDECREF(kv.second.launch);
    plans.clear();
  }
  // Forget every copy if Python's table may have changed since they were taken.
  void refresh() {
    uint64_t now = __atomic_load_n(g_plan_epoch, __ATOMIC_ACQUIRE);
    uint64_t gen = g_fork_gen.load(std::memory_order_relaxed);
    if (now != epoch || gen != fork_gen) {
      clear();
      epoch = now;
      fork_gen = gen;
    }
  }
};
HotPlans* g_hot_plans = new HotPlans;  // never destroyed: it holds Python objects

// Appends a number to a key: its kind (1 float, 2 int, 3 bool) and bits. False when no
// plan can key on it (complex, symbolic, or NaN, which is never equal to its key).
bool append_number(std::string& key, const c10::Scalar& x) {
  char kind;
  int64_t bits;
  if (x.isSymbolic()) return false;
  if (x.isBoolean()) {
    kind = 3;
    bits = x.toBool();
  } else if (x.isIntegral(false)) {
    kind = 2;
    bits = x.toLong();
  } else if (x.isFloatingPoint()) {
    double d = x.toDouble();
    if (d != d) return false;
    kind = 1;
    std::memcpy(&bits, &d, sizeof bits);
  } else {
    return false;
  }
  key.push_back(kind);
  key.append(reinterpret_cast<const char*>(&bits), sizeof bits);
  return true;
}

// The number a wrapped-number tensor holds: torch makes the 2 of ``x + 2`` a 0-d CPU
// tensor (double, int64 or bool), which the Python kernel reads as that number.
std::optional<c10::Scalar> wrapped_number(const at::Tensor& t) {
  if (!t.unsafeGetTensorImpl()->is_wrapped_number() || !t.is_cpu()) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kDouble: return c10::Scalar(*static_cast<const double*>(t.const_data_ptr()));
    case at::kLong: return c10::Scalar(*static_cast<const int64_t*>(t.const_data_ptr()));
    case at::kBool: return c10::Scalar(*static_cast<const bool*>(t.const_data_ptr()));
    default: return std::nullopt;
  }
}

// A tensor a plan can take as it is: dense, on accel, contiguous, not empty.
bool plannable(const at::Tensor& t) {
  return t.device().type() == kAccel && t.layout() == c10::kStrided && t.numel() > 0 &&
         t.is_contiguous();
}

// One call of a hot operator, as the dispatcher gave it.
struct HotCall {
  int op;
  int form;                  // 0 Tensor, 1 Scalar, 2 in-place Tensor, 3 in-place Scalar
  const at::Tensor& self;
  const at::Tensor* other;   // the Tensor forms' other
  const c10::Scalar* scalar; // the Scalar forms' other
  const c10::Scalar& alpha;

  bool in_place() const { return form >= 2; }

  // The number ``other`` stands for, if it is one.
  std::optional<c10::Scalar> number() const {
    return scalar ? std::optional<c10::Scalar>(*scalar) : wrapped_number(*other);
  }

  // The key of this call's plan; empty when it cannot have one.
  std::string key(const std::optional<c10::Scalar>& number) const {
    if (!plannable(self)) return {};
    if (!number) {
      const at::Tensor& b = *other;
      if (b.device() != self.device() || b.scalar_type() != self.scalar_type() ||
          b.sizes() != self.sizes() || !plannable(b))
        return {};
    }
    int64_t head[3] = {op << 8 | form, self.device().index(),
                       static_cast<int64_t>(self.scalar_type()) << 32 | self.dim()};
    std::string key(reinterpret_cast<const char*>(head), sizeof head);
    if (!append_number(key, alpha) || (number && !append_number(key, *number))) return {};
    auto sizes = self.sizes();
    key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
    return key;
  }

  // The Python kernel's answer (the GIL is held): every call without a plan.
  at::Tensor in_python() const {
    py::object b = other ? py::cast(*other) : py::cast(*scalar);
    py::handle kernel(g_hot[op].kernel[form]);
    py::object out = g_hot[op].alpha ? kernel(self, b, py::arg("alpha") = alpha)
                                     : kernel(self, b);
    return out.cast<at::Tensor>();
  }

  // This kind of call's plan: the copy under ``key``, else Python's, copied (the GIL is
  // held). Python's errors (the fork check's, a lost device's) are thrown as themselves.
  const HotPlan& plan(const std::string& key, const std::optional<c10::Scalar>& number) const {
    g_hot_plans->refresh();
    auto& plans = g_hot_plans->plans;
    auto found = plans.find(key);
    if (found != plans.end()) return found->second;
    py::object b = number ? py::cast(*number) : py::cast(*other);
    py::object got = py::handle(g_hot_plan)(op, self, b, alpha, in_place());
    HotPlan plan;
    if (!got.is_none()) {
      auto pair = got.cast<py::tuple>();
      auto sources = pair[1].cast<std::vector<int>>();
      TORCH_CHECK(sources.size() <= 3, "hot_plan: ", sources.size(), " buffers");
      for (size_t i = 0; i < sources.size(); ++i) {
        TORCH_CHECK(sources[i] >= -1 && sources[i] <= (number ? 0 : 1),
                    "hot_plan: a buffer from operand ", sources[i]);
        plan.sources[i] = static_cast<int8_t>(sources[i]);
      }
      plan.n = static_cast<int>(sources.size());
      plan.launch = py::object(pair[0]).release().ptr();
    }
    if (plans.size() >= kMaxHotPlans) g_hot_plans->clear();
    return plans.emplace(key, plan).first->second;
  }

  // The launch of ``plan`` into ``out`` (the GIL is held); false when a buffer is not an
  // allocator block (a DLPack import), which the Python kernel resolves.
  bool launch(const HotPlan& plan, const at::Tensor& out) const {
    const at::Tensor* from[3] = {&out, &self, other};
    py::object buffers = py::reinterpret_steal<py::object>(PyTuple_New(plan.n));
    if (!buffers) throw py::error_already_set();
    for (int i = 0; i < plan.n; ++i) {
      PyObject* pair = buffer_of(*from[plan.sources[i] + 1]);
      if (pair == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return false;
      }
      PyTuple_SET_ITEM(buffers.ptr(), i, pair);
    }
    auto done = py::reinterpret_steal<py::object>(PyObject_CallOneArg(plan.launch, buffers.ptr()));
    if (!done) throw py::error_already_set();
    return true;
  }

  // The call: its plan's launch, or the Python kernel.
  at::Tensor run() const {
    TORCH_CHECK(g_hot_plan != nullptr, "torch_accel is not initialised (import torch_accel)");
    auto b = number();
    std::string k = key(b);
    Entry entry;
    TORCH_CHECK(entry, "torch_accel: the interpreter is exiting (an operator refused)");
    py::gil_scoped_acquire gil;
    if (!k.empty() && !sanitizing()) {
      // a copy, its launch held: the allocation and the launch run Python, which may
      // let another thread clear the map meanwhile
      HotPlan p = plan(k, b);
      auto held = py::reinterpret_borrow<py::object>(p.launch);
      if (p.launch != nullptr) {
        at::Tensor out = in_place() ? self
            : empty_memory_format(self.sizes(), self.scalar_type(), std::nullopt,
                                  self.device(), std::nullopt, c10::MemoryFormat::Contiguous);
        if (launch(p, out)) return out;
      }
    }
    return in_python();
  }
};

template <int Op>
at::Tensor hot_tensor(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
  return HotCall{Op, 0, a, &b, nullptr, alpha}.run();
}
template <int Op>
at::Tensor hot_scalar(const at::Tensor& a, const c10::Scalar& b, const c10::Scalar& alpha) {
  return HotCall{Op, 1, a, nullptr, &b, alpha}.run();
}
template <int Op>
at::Tensor& hot_tensor_(at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) {
  HotCall{Op, 2, a, &b, nullptr, alpha}.run();
  return a;
}
template <int Op>
at::Tensor& hot_scalar_(at::Tensor& a, const c10::Scalar& b, const c10::Scalar& alpha) {
  HotCall{Op, 3, a, nullptr, &b, alpha}.run();
  return a;
}
// mul and div take no alpha
const c10::Scalar kOne(1);
template <int Op>
at::Tensor hot_tensor_na(const at::Tensor& a, const at::Tensor& b) {
  return hot_tensor<Op>(a, b, kOne);
}
template <int Op>
at::Tensor hot_scalar_na(const at::Tensor& a, const c10::Scalar& b) {
  return hot_scalar<Op>(a, b, kOne);
}
template <int Op>
at::Tensor& hot_tensor_na_(at::Tensor& a, const at::Tensor& b) {
  return hot_tensor_<Op>(a, b, kOne);
}
template <int Op>
at::Tensor& hot_scalar_na_(at::Tensor& a, const c10::Scalar& b) {
  return hot_scalar_<Op>(a, b, kOne);
}

// Registers op ``Op``'s four overloads (``name.Tensor``, ``name.Scalar``, ``name_.Tensor``,
// ``name_.Scalar``) on accel.
template <int Op>
void register_hot(torch::Library& lib, const std::string& name, bool alpha) {
  if (alpha) {
    lib.impl((name + ".Tensor").c_str(), TORCH_FN(hot_tensor<Op>));
    lib.impl((name + ".Scalar").c_str(), TORCH_FN(hot_scalar<Op>));
    lib.impl((name + "_.Tensor").c_str(), TORCH_FN(hot_tensor_<Op>));
    lib.impl((name + "_.Scalar").c_str(), TORCH_FN(hot_scalar_<Op>));
  } else {
    lib.impl((name + ".Tensor").c_str(), TORCH_FN(hot_tensor_na<Op>));
    lib.impl((name + ".Scalar").c_str(), TORCH_FN(hot_scalar_na<Op>));
    lib.impl((name + "_.Tensor").c_str(), TORCH_FN(hot_tensor_na_<Op>));
    lib.impl((name + "_.Scalar").c_str(), TORCH_FN(hot_scalar_na_<Op>));
  }
}

// _hot_binary(op, name, kernels, alpha): registers ``name``'s four overloads above as op
// index ``op``, with ``kernels`` (one Python kernel per form) behind them.
void hot_binary(int op, const std::string& name, const std::vector<py::object>& kernels,
                bool alpha) {
  TORCH_CHECK(op >= 0 && op < kHotOps, "_hot_binary: op index ", op, " of ", kHotOps);
  TORCH_CHECK(kernels.size() == kHotForms, "_hot_binary: ", kHotForms, " kernels, got ",
              kernels.size());
  TORCH_CHECK(g_hot[op].kernel[0] == nullptr, "_hot_binary: op ", op, " registered twice");
  for (int i = 0; i < kHotForms; ++i) g_hot[op].kernel[i] = py::object(kernels[i]).release().ptr();
  g_hot[op].alpha = alpha;
  static auto* lib = new torch::Library(torch::Library::IMPL, "aten",
                                        c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  switch (op) {
    case 0: register_hot<0>(*lib, name, alpha); break;
    case 1: register_hot<1>(*lib, name, alpha); break;
    case 2: register_hot<2>(*lib, name, alpha); break;
    default: register_hot<3>(*lib, name, alpha); break;
  }
}

PyMethodDef g_plan_methods[] = {
    {"_signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&signature)),
     METH_FASTCALL, "a launch plan's key of tensors: device, dtype, sizes, strides"},
    {"_buffers", &buffers, METH_O, "per tensor (its storage's runtime array, byte offset)"},
    {"_empty_like", &empty_like, METH_O, "torch.empty_like of a contiguous accel tensor"},
    {nullptr, nullptr, 0, nullptr}};

std::once_flag g_registered;

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &::fused_sdp_choice)
}  // namespace at::native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_accel's C++ shim (see shim.cpp's header)";
  m.def("_register", [](py::object hooks) {
    std::call_once(g_registered, [&] {
      g_hooks = new py::object(std::move(hooks));  // lives as long as the process
      g_alloc_fn = py::object(g_hooks->attr("alloc")).release().ptr();
      g_blocks = py::object(g_hooks->attr("blocks")).release().ptr();
      g_va = PyUnicode_InternFromString("va");
      c10::SetAllocator(kAccel, &g_allocator);
      at::RegisterPrivateUse1HooksInterface(new AccelHooks());
      torch::profiler::impl::registerPrivateUse1Methods(&g_profiler_stubs);
      py::module_::import("atexit").attr("register")(py::cpp_function(&quiesce));
      // a forked child has only the forking thread: no call of another is inside
      g_epoch = reinterpret_cast<const uint64_t*>(
          py::module_::import("ctypes").attr("addressof")(
              py::module_::import("runtime.devices").attr("current_epoch")).cast<uintptr_t>());
      pthread_atfork(nullptr, nullptr, [] {
        g_entries.store(0);
        g_pid = getpid();
        g_fork_gen.fetch_add(1);
      });
    });
  });
  m.def("_philox_take", [](const at::Generator& gen, uint64_t increment) {
    TORCH_CHECK(gen.device().type() == kAccel, "expected an accel generator, got one on ",
                gen.device());
    auto* impl = at::check_generator<AccelGenerator>(gen);
    return impl->take(increment);
  }, "(seed, offset) for a draw of `increment` counter values; moves the offset past them");
  m.def("_default_generator", [](DeviceIndex index) {
    return at::detail::getPrivateUse1Hooks().getDefaultGenerator(index);
  }, "the device's default generator (what torch.manual_seed seeds)");
  m.def("_block_tensor", [](DeviceIndex device, intptr_t va, size_t nbytes) {
    // a uint8 tensor over a block the hooks hold in `blocks` but the allocator did not hand
    // out (memory another process shared): its storage frees it through `free`, as theirs
    py::object array = g_hooks->attr("blocks")[py::make_tuple(device, va)];
    c10::DataPtr p(reinterpret_cast<void*>(va), new Block{va, device, array.release().ptr(), g_pid},
                   &free_block, accel(device));
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(p), nullptr, false);
    auto t = at::empty({0}, at::TensorOptions().dtype(at::kByte).device(accel(device)));
    return t.set_(storage, 0, {static_cast<int64_t>(nbytes)}, {1});
  }, "a uint8 tensor whose storage is the block at (device, va) of nbytes");
  PyModule_AddFunctions(m.ptr(), g_plan_methods);
  m.def("_hot_binary", &hot_binary,
        "registers the shim's kernels of an operator's Tensor, Scalar and in-place overloads");
  m.def("_hot_plan", [](py::object fn, uintptr_t epoch, py::module_ sanitizer) {
    TORCH_CHECK(g_hot_plan == nullptr, "_hot_plan: registered twice");
    g_hot_plan = fn.release().ptr();
    g_plan_epoch = reinterpret_cast<const uint64_t*>(epoch);
    g_sanitizer = py::object(sanitizer.attr("__dict__")).release().ptr();
    g_active = PyUnicode_InternFromString("active");
  }, "the Python function a hot kernel asks for its plan, the plans' epoch word's address "
     "and the runtime's sanitizer module (while it is on, every call takes Python)");
  m.def("_storage_block", [](const at::Tensor& t) {
    // (device, block address) of a tensor's storage: the runtime block it lives in
    const auto& p = t.storage().data_ptr();
    auto* block = static_cast<Block*>(p.get_context());
    TORCH_CHECK(p.get_deleter() == &free_block && block, "tensor's storage is not an accel block");
    return std::make_pair(block->device, block->va);
  });
}
