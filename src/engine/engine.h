// File: src/engine/engine.h
//
// The transport engine: ordered byte streams in both directions over RC
// queue pairs set up with RDMA CM. No gRPC here; src/glue adapts it.
//
//   auto engine = Engine::Create(options);           // one per process
//   engine->Listen(addr, [](std::shared_ptr<Connection> c) { ... });
//   engine->Connect(addr, 1000, [](absl::StatusOr<std::shared_ptr<Connection>> c) { ... });
//   conn->Write({iov...}, [](absl::Status s) { /* buffers may be reused */ });
//   conn->Read([](absl::StatusOr<RecvChunks> r) { ... });
//
// Small writes are copied into registered buffers and coalesced, up to the
// peer's TF_RDMA_ACC_SIZE, into one SEND (eager, credit-gated); a write
// larger than that is announced and then pulled into buffers the receiver
// grants, TF_RDMA_CHUNK_SIZE at a time, several in flight (rendezvous), and
// those buffers are handed to the reader without a copy.
//
// Threading: one poller thread per Engine handles RDMA CM events and
// completions. Callbacks (connect, accept, read, write done) run with no
// engine lock held, on the poller thread, or at once on the calling thread
// when the result is already there (Read with data queued, Write on a
// closed connection): do not hold a lock the callback takes while calling
// Read or Write. Write, Read and Shutdown may be called from any thread,
// including from callbacks. Do not destroy the Engine from its callbacks.
#ifndef GRPC_RDMA_SRC_ENGINE_ENGINE_H_
#define GRPC_RDMA_SRC_ENGINE_ENGINE_H_

#include <netinet/in.h>
#include <sys/uio.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "grpc_rdma/options.h"
#include "grpc_rdma/stats.h"

namespace grpc_rdma {

class Connection;
class EngineImpl;

// Memory for the received bytes the engine copies out of registered
// buffers (eager messages; rendezvous chunks it copies rather than lends).
// By default the heap. A reader that hands the bytes on in memory of its
// own (the glue: gRPC slices) supplies it, so the bytes are copied once,
// straight into it, and never again: `allocate` returns an owner token for
// `size` writable bytes at *data (nullptr: none, the heap is used), and
// `release(owner)` frees them. Both may run on any thread.
struct ChunkMemory {
  void* (*allocate)(size_t size, char** data) = nullptr;
  void (*release)(void* owner) = nullptr;
};

// Received stream bytes: a registered buffer lent to the reader (zero-copy;
// given back when the chunk is destroyed), memory from the reader's
// ChunkMemory, or the heap.
class RecvChunk {
 public:
  RecvChunk() = default;
  RecvChunk(RecvChunk&& o) noexcept;
  RecvChunk& operator=(RecvChunk&& o) noexcept;
  RecvChunk(const RecvChunk&) = delete;
  RecvChunk& operator=(const RecvChunk&) = delete;
  ~RecvChunk();

  const char* data() const { return data_; }
  size_t size() const { return size_; }
  // True when data() points into a registered buffer (no copy was made).
  bool zero_copy() const { return static_cast<bool>(release_); }
  // The ChunkMemory owner token of the bytes, if they are in such memory.
  void* owner() const { return owner_; }
  // Hands the bytes over to the caller, who releases the owner token
  // itself; the chunk is empty afterwards. nullptr (and no change) unless
  // the bytes are in ChunkMemory.
  void* TakeOwner();

  static RecvChunk Owned(std::string bytes);
  static RecvChunk Lent(const char* data, size_t size, std::function<void()> release);
  // A copy of `size` bytes at `src`, in `memory` if it allocates.
  static RecvChunk Copy(const char* src, size_t size, const ChunkMemory& memory);

 private:
  void Clear();

  const char* data_ = nullptr;
  size_t size_ = 0;
  std::string owned_;
  std::function<void()> release_;
  void* owner_ = nullptr;
  void (*owner_release_)(void*) = nullptr;
};

// What one read hands over: the chunks received, in order. Most reads of
// small messages hand over one or two, which then need no heap.
using RecvChunks = absl::InlinedVector<RecvChunk, 2>;

// One connection's counters (grpc_rdma/stats.h says what each counts).
using ConnectionStats = StreamStats;

class Connection {
 public:
  using WriteDone = std::function<void(absl::Status)>;
  using ReadDone = std::function<void(absl::StatusOr<RecvChunks>)>;

  virtual ~Connection() = default;
  // Queues the bytes `data` points at (borrowed until `done` runs; the
  // iovecs themselves are copied before Write returns) for the peer, in
  // order after earlier writes. `done` runs once the bytes are out of
  // `data`'s buffers: OK, or UNAVAILABLE if the connection closed first.
  virtual void Write(absl::Span<const iovec> data, WriteDone done) = 0;
  // The same, with the bytes kept valid by `keep` (references on the
  // writer's buffers) instead of by the wait for `done`: `done` may then
  // run once the bytes are posted, before the device has read them, so the
  // writer goes on while the device moves them; `keep` is let go once the
  // device reads them no more (outside the connection's lock, on any
  // thread). Only where zero_copy_sends() does it change anything. A
  // chunk that fails after `done` ran OK fails the connection (as a TCP
  // write the kernel took and could not deliver).
  virtual void Write(absl::Span<const iovec> data, WriteDone done,
                     std::shared_ptr<const void> keep) {
    Write(data, [done = std::move(done), keep = std::move(keep)](absl::Status s) { done(s); });
  }
  // Whether large writes may go from the writer's own buffers (zero-copy:
  // TF_RDMA_ZERO_COPY, and a device with on-demand paging): only then is a
  // `keep` worth building.
  virtual bool zero_copy_sends() const { return false; }
  // `done` runs once with the bytes available (at least one), or with
  // UNAVAILABLE when the stream ended (peer closed, died, or Shutdown):
  // always, at the latest when the connection closes. One read at a time:
  // a Read while one is pending fails at once with FAILED_PRECONDITION.
  virtual void Read(ReadDone done) = 0;
  // Fails pending and later reads and writes with `why` (UNAVAILABLE); data
  // received and not read is dropped. Writes already reported done still
  // reach the peer: the disconnect waits for their completions. Idempotent.
  virtual void Shutdown(absl::Status why) = 0;
  // For a host event loop that polls each connection on its own (gRPC's
  // pollers hand different descriptors to different threads, so calls on
  // different connections are handled in parallel, as with TCP): a
  // descriptor that becomes readable when this connection has completions
  // to handle (-1 once it has none), and a call that handles them without
  // blocking, running callbacks on the calling thread (false: nothing to
  // do). While SetHostPolled(true), the engine's poller watches this
  // descriptor only as a backstop (every 20 ms while the host polls, after
  // a grace when it does not); false gives it back. Do not close the
  // descriptor.
  virtual int event_fd() const = 0;
  virtual bool PollNow() = 0;
  // PollNow in parts. `take_events`: the descriptor said readable, so take
  // the events queued on it (a look that finds none costs system calls:
  // false for a spinning thread's repeated looks). `arm`: arm the CQ, then
  // look once more, as PollNow does. A host thread that spins may leave
  // the CQ unarmed: it keeps looking, so the connection's completions need
  // raise no event (over softverbs the peer then rings no doorbell, and
  // arming costs no system call per message); it must poll with `arm`
  // before it stops looking, or a completion may wake nobody.
  virtual bool Poll(bool take_events, bool arm) = 0;
  // Whether a message of kLargeMessage or more (sent by rendezvous, or a
  // received chunk that long) moved since the last call. A spinning host
  // thread polls small messages' connections; a stream of large ones is
  // left to its events.
  static constexpr size_t kLargeMessage = 64 * 1024;
  virtual bool LargeMessagesMoved() = 0;
  virtual void SetHostPolled(bool on) = 0;
  virtual std::string peer() const = 0;   // "rdma:10.0.0.2:50051"
  virtual std::string local() const = 0;
  // The RDMA device the connection runs on ("mlx5_0").
  virtual std::string device() const = 0;
  // On an accepted connection, the TCP connection the client said this one
  // joins ("10.0.0.2:41234", the client's end of it, as the server's TCP
  // sees the peer); "" when it joins none. The client asks so with
  // Engine::Connect's `joins`.
  virtual std::string joins() const = 0;
  // With joins(): the join token the client's Hello carried
  // (kJoinTokenBytes bytes), "" if it carried none.
  virtual std::string join_token() const = 0;
  virtual ConnectionStats stats() const = 0;
  // What the connection is doing, in one line, for diagnosing one that
  // does not go away: its state (and why it closed), the reads and writes
  // pending, sends in flight, grants out, and the bytes it moved.
  virtual std::string Describe() const = 0;
};

// What a client's RDMA connection says of the TCP connection it joins
// (TF_RDMA_TCP_FIRST): the client's end of it, and a random token the
// client also wrote into that TCP stream, so that the server joins the two
// only for the process that owns the stream (docs/wire-protocol.md).
constexpr size_t kJoinTokenBytes = 16;
struct JoinRequest {
  sockaddr_in tcp{};
  uint8_t token[kJoinTokenBytes] = {};
};

class Engine {
 public:
  using ConnectDone = std::function<void(absl::StatusOr<std::shared_ptr<Connection>>)>;
  using AcceptFn = std::function<void(std::shared_ptr<Connection>)>;

  // Validates the options, picks the device (TF_RDMA_DEV_NAME) and starts
  // the poller. UNAVAILABLE when there is no RDMA device at all.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Options& options,
                                                      ChunkMemory memory = {});
  // Closes every connection (their operations fail) and stops the poller.
  // Connections and chunks the application still holds stay valid objects
  // (their operations fail with UNAVAILABLE).
  ~Engine();

  // Connects to `addr` over RDMA CM; `done` runs on the poller with the
  // connection, or UNAVAILABLE (no RDMA path, rejected, no answer within
  // `timeout_ms`). `joins`, if given, names the TCP connection (our end of
  // it) that this one joins, and its token: the server's
  // Connection::joins() and join_token() say them.
  // Returns the connection being made (empty if it failed at once), for
  // CancelConnect.
  std::weak_ptr<Connection> Connect(const sockaddr_in& addr, int timeout_ms, ConnectDone done,
                                    const JoinRequest* joins = nullptr);
  // Gives up a connect still under way, as its timeout would: `done` runs
  // with UNAVAILABLE and nothing more is set up. No effect once it is done.
  void CancelConnect(const std::weak_ptr<Connection>& connecting);
  // Listens on `addr` (port 0: any); returns the port. `on_accept` runs on
  // the poller for each established connection.
  absl::StatusOr<uint16_t> Listen(const sockaddr_in& addr, AcceptFn on_accept);
  // Stops the listener Listen made for `addr` (with the port it returned):
  // later connection requests are refused and connections already made
  // carry on. A connection accepted just before may still reach that
  // listener's `on_accept` afterwards.
  void StopListening(const sockaddr_in& addr);

  // For a host event loop (gRPC's pollers): a descriptor that becomes
  // readable when the engine has something to handle, and a call that
  // handles what is ready without blocking, running callbacks on the calling
  // thread. Do not close the descriptor. While SetExternalPolling(true),
  // the engine's poller does not spin; while the host loop calls PollNow
  // (it did within 100 ms), the poller wakes only every 20 ms in case the
  // host stops; otherwise it leaves each event to the host for 250 us
  // before handling it itself. So the host thread that waits for a
  // completion is the one that handles it, and nothing stalls for long
  // when no host thread polls.
  int event_fd() const;
  bool PollNow();
  void SetExternalPolling(bool on);
  uint64_t host_polls() const;  // PollNow calls that found something to do

  const Options& options() const;
  uint64_t pinned_bytes() const;  // registered memory in use, all connections
  uint64_t poller_wakeups() const;  // times something woke the poller thread
  // Connection requests refused: not grpc-rdma's, on another device than
  // TF_RDMA_DEV_NAME, or no resources to set them up.
  uint64_t refused() const;
  // Connections a fault closed (each ConnectionStats::connection_errors),
  // including those that failed before the application got them.
  uint64_t connection_errors() const;

 private:
  explicit Engine(std::shared_ptr<EngineImpl> impl);
  std::shared_ptr<EngineImpl> impl_;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_ENGINE_H_
