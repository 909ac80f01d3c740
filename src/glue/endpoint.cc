#include "glue/endpoint.h"

#include <grpc/slice.h>
#include <grpc/slice_buffer.h>
#include <grpc/support/alloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "glue/handoff.h"
#include "glue/runtime.h"
#include "glue/slice_pool.h"
#include "glue/stats.h"
#include "glue/trace.h"
#include "src/core/lib/iomgr/closure.h"
#include "src/core/lib/iomgr/error.h"
#include "src/core/lib/iomgr/exec_ctx.h"
#include "src/core/lib/slice/slice_refcount.h"

namespace grpc_rdma {
namespace {

// Below this a received chunk not already in a slice (the engine's heap
// memory: only without SliceChunkMemory) is copied into a gRPC slice:
// cheaper than a heap-held chunk and a refcounted slice around it.
constexpr size_t kCopyBelow = 512;

// The shared state of one endpoint: the grpc_endpoint itself goes at
// destroy, while callbacks the engine still owes hold this.
struct State {
  std::mutex mu;  // guards conn, released, shut_down, why and the read's fields (gRPC serialises the rest)
  std::shared_ptr<Connection> conn;  // null once released (Release)
  bool released = false;
  absl::Status why;  // what released it: later reads and writes fail with it
  std::string peer, local;
  bool server = false;
  bool polling = false;  // acquired gRPC polling of the engine
  bool shut_down = false;  // released by gRPC's shutdown (before its destroy)
  PollRegistration* conn_polling = nullptr;  // gRPC polls the connection's own descriptor
  // The read in progress (gRPC has one at a time per endpoint), guarded by
  // mu: kept here, not in the engine's callback, so that callback holds
  // one pointer and std::function keeps it without the heap. `reading`
  // holds this state until the read completes (the engine calls every
  // read's callback once, at the latest when the connection closes).
  std::shared_ptr<State> reading;
  grpc_slice_buffer* read_slices = nullptr;
  grpc_closure* read_cb = nullptr;
  // Bytes copied here (received small chunks into gRPC slices, pieces of
  // large writes kept for the device): the connection's
  // bytes_copied_on_receive and bytes_copied_on_send besides the engine's.
  EndpointCopies copies;
};

struct RdmaEndpoint {
  grpc_endpoint base;  // first: gRPC hands back this pointer
  std::shared_ptr<State> st;
};

State* Of(grpc_endpoint* ep) { return reinterpret_cast<RdmaEndpoint*>(ep)->st.get(); }
std::shared_ptr<State> Share(grpc_endpoint* ep) { return reinterpret_cast<RdmaEndpoint*>(ep)->st; }

// "rdma:10.0.0.2:50051" (the engine's) -> "ipv4:10.0.0.2:50051?transport=rdma":
// gRPC parses peer and local addresses as URIs of scheme ipv4 (xDS filter
// chains, authorization policies, local credentials), reading the path;
// the query says which transport, for people and logs.
std::string GrpcAddress(const std::string& engine_address) {
  constexpr absl::string_view kRdma = "rdma:";
  if (absl::string_view(engine_address).substr(0, kRdma.size()) != kRdma) return engine_address;
  return absl::StrCat("ipv4:", engine_address.substr(kRdma.size()), "?transport=rdma");
}

void* AllocateSlice(size_t size, char** data) { return AllocatePooledSlice(size, data); }

grpc_slice SliceOf(void* owner, const char* data, size_t size) {
  grpc_slice s;
  s.refcount = static_cast<grpc_slice_refcount*>(owner);
  s.data.refcounted.bytes = reinterpret_cast<uint8_t*>(const_cast<char*>(data));
  s.data.refcounted.length = size;
  return s;
}

void ReleaseSlice(void* owner) { grpc_slice_unref(SliceOf(owner, nullptr, 0)); }

grpc_slice ToSlice(RecvChunk chunk, std::atomic<uint64_t>* copied) {
  if (chunk.owner() != nullptr) {  // in a slice already (SliceChunkMemory)
    const char* data = chunk.data();
    size_t size = chunk.size();
    void* owner = chunk.TakeOwner();
    HandedToGrpc(owner);  // its last unref (slice_pool.cc) may come on any thread
    return SliceOf(owner, data, size);
  }
  if (chunk.size() < kCopyBelow) {
    copied->fetch_add(chunk.size(), std::memory_order_relaxed);
    return grpc_slice_from_copied_buffer(chunk.data(), chunk.size());
  }
  auto* held = new RecvChunk(std::move(chunk));
  const char* data = held->data();
  size_t size = held->size();
  HandedToGrpc(held);  // after its last use here: gRPC's last unref (any thread) frees it
  return grpc_slice_new_with_user_data(const_cast<char*>(data), size,
                                       [](void* p) {
                                         TakenFromGrpc(p);
                                         delete static_cast<RecvChunk*>(p);
                                       },
                                       held);
}

// The connection, or null (and why) once the endpoint let it go.
std::shared_ptr<Connection> Held(State* st, absl::Status* why) {
  std::lock_guard<std::mutex> g(st->mu);
  if (st->conn == nullptr) *why = st->why;
  return st->conn;
}

// Lets the connection go, at shutdown already, not only at destroy: shut
// down (reads and writes pending or later fail), no longer polled, its
// counts final, and the engine's reference the last one, so its QP and
// pinned buffers are freed once its disconnect is done. gRPC 1.51 can
// keep a shut-down endpoint for good: a connection whose subchannel was
// shut down while it waited for the server's SETTINGS is never destroyed
// (Subchannel::OnConnectingFinishedLocked drops the transport, fixed after
// 1.51 by grpc/grpc#32071); what stays is this small state, as a TCP
// endpoint leaks its descriptor there.
bool Release(State* st, absl::Status why, bool by_shutdown = false) {
  std::shared_ptr<Connection> conn;
  {
    std::lock_guard<std::mutex> g(st->mu);
    if (st->released) return false;
    st->released = true;
    st->shut_down = by_shutdown;
    st->why = why;
    conn = std::move(st->conn);
    st->conn = nullptr;
  }
  conn->Shutdown(std::move(why));
  if (st->conn_polling != nullptr) Runtime::Get()->StopPollingConnection(st->conn_polling, conn.get());
  st->conn_polling = nullptr;
  UntrackConnection(conn.get());
  GlobalCounters().rdma_open.fetch_sub(1);
  if (st->polling) Runtime::Get()->ReleasePolling();
  st->polling = false;
  GRPC_RDMA_TRACE("%s: closed (%s side)", st->peer.c_str(), st->server ? "server" : "client");
  return true;
}

void EpRead(grpc_endpoint* ep, grpc_slice_buffer* slices, grpc_closure* cb, bool /*urgent*/,
            int /*min_progress_size*/) {
  // As gRPC's TCP endpoint: a read replaces what the buffer held.
  grpc_slice_buffer_reset_and_unref(slices);
  std::shared_ptr<State> st = Share(ep);
  absl::Status gone;
  std::shared_ptr<Connection> conn = Held(st.get(), &gone);
  if (conn == nullptr) {
    RunClosure(cb, ToGrpcError(gone));
    return;
  }
  State* raw = st.get();
  {
    // Under mu: the callback may run on the engine's thread, and the next
    // read on another, ordered only by gRPC (which ThreadSanitizer does
    // not see).
    std::lock_guard<std::mutex> g(raw->mu);
    raw->read_slices = slices;
    raw->read_cb = cb;
    raw->reading = std::move(st);
  }
  conn->Read([raw](absl::StatusOr<RecvChunks> r) {
    std::shared_ptr<State> st;
    grpc_slice_buffer* slices;
    grpc_closure* cb;
    {
      std::lock_guard<std::mutex> g(raw->mu);
      st = std::move(raw->reading);
      slices = raw->read_slices;
      cb = raw->read_cb;
    }
    if (!r.ok()) {
      grpc_slice_buffer_reset_and_unref(slices);
      GRPC_RDMA_TRACE("%s: read ended: %s", st->peer.c_str(),
                      std::string(r.status().message()).c_str());
      RunClosure(cb, ToGrpcError(r.status()));
      return;
    }
    for (RecvChunk& c : *r) {
      if (c.size() > 0) grpc_slice_buffer_add(slices, ToSlice(std::move(c), &st->copies.received));
    }
    RunClosure(cb, absl::OkStatus());
  });
}

// A large write's bytes, kept for the device after gRPC has the write
// back: a reference on each slice that has one, and a copy of the pieces
// that have none. chttp2 cuts a message at the flow-control window with
// grpc_slice_buffer_move_first_no_ref (the head piece's bytes live only
// as long as the rest of the slice, which may go in the next write and be
// freed with it, or be dropped with a cancelled stream), and frame headers
// are inlined in the slice itself (gone with the slice buffer): both are
// copied. References are let go on whichever thread the device finishes
// on, with an ExecCtx if it has none (a slice's destroyer may need one).
struct WriteKeep {
  absl::InlinedVector<grpc_slice, 8> refs;
  std::unique_ptr<char[]> copies;
  WriteKeep() = default;
  WriteKeep(const WriteKeep&) = delete;
  WriteKeep& operator=(const WriteKeep&) = delete;
  ~WriteKeep() {
    if (grpc_core::ExecCtx::Get() != nullptr) {
      for (const grpc_slice& s : refs) grpc_slice_unref(s);
      return;
    }
    grpc_core::ExecCtx exec_ctx;
    for (const grpc_slice& s : refs) grpc_slice_unref(s);
  }
};

// A slice whose bytes its reference keeps: not inlined (no refcount) and
// not borrowed (grpc_slice_refcount::NoopRefcount(), for pieces split off
// without a reference and for static slices).
bool HasOwnReference(const grpc_slice& s) {
  return s.refcount != nullptr && s.refcount != grpc_slice_refcount::NoopRefcount();
}

// Writes this large or larger go with a WriteKeep where the connection
// sends zero-copy (chunks of 1 MiB and more from the writer's buffers), so
// gRPC gets such a write back once it is posted instead of once the device
// has read it, and serializes its next message meanwhile: 4 MiB client
// streams 1.18-1.30x as fast here. From 1 MiB, 1 MiB streams lost in one
// of three interleaved runs (0.83-0.86x, docs/performance.md, "Large
// writes kept for the device"); writes under 2 MiB go as before.
constexpr size_t kKeptWriteMin = 2 << 20;
// ... unless more than this of it would have to be copied (a message's
// head cut at the flow-control window, up to 1 MiB): the writer's copy
// would cost it about what the wait for the device's copy does, and add
// up to a third of a copy per byte sent (measured: 4 MiB client streams
// gained as much without those writes).
constexpr size_t kKeptCopyMax = 64 << 10;

void EpWrite(grpc_endpoint* ep, grpc_slice_buffer* slices, grpc_closure* cb, void* /*arg*/,
             int /*max_frame_size*/) {
  absl::Status gone;
  std::shared_ptr<Connection> conn = Held(Of(ep), &gone);
  if (conn == nullptr) {
    RunClosure(cb, ToGrpcError(gone));
    return;
  }
  NoteRdmaActivity();  // the answer is due soon: gRPC's poller may spin for it
  auto done = [cb](absl::Status s) { RunClosure(cb, s.ok() ? absl::OkStatus() : ToGrpcError(s)); };
  absl::InlinedVector<iovec, 8> iov;  // the engine copies it: no heap for small writes
  const bool large = slices->length >= kKeptWriteMin && conn->zero_copy_sends();
  size_t to_copy = 0;
  if (large) {
    for (size_t i = 0; i < slices->count; ++i) {
      if (!HasOwnReference(slices->slices[i])) to_copy += GRPC_SLICE_LENGTH(slices->slices[i]);
    }
  }
  if (!large || to_copy > kKeptCopyMax) {
    for (size_t i = 0; i < slices->count; ++i) {
      size_t n = GRPC_SLICE_LENGTH(slices->slices[i]);
      if (n > 0) iov.push_back({GRPC_SLICE_START_PTR(slices->slices[i]), n});
    }
    // The slices stay the caller's, untouched, until cb runs.
    conn->Write(iov, std::move(done));
    return;
  }
  auto keep = std::make_shared<WriteKeep>();
  if (to_copy > 0) keep->copies.reset(new char[to_copy]);
  char* at = keep->copies.get();
  for (size_t i = 0; i < slices->count; ++i) {
    grpc_slice& s = slices->slices[i];
    size_t n = GRPC_SLICE_LENGTH(s);
    if (n == 0) continue;
    if (HasOwnReference(s)) {
      keep->refs.push_back(grpc_slice_ref(s));
      iov.push_back({GRPC_SLICE_START_PTR(s), n});
    } else {
      memcpy(at, GRPC_SLICE_START_PTR(s), n);
      iov.push_back({at, n});
      at += n;
    }
  }
  Of(ep)->copies.sent.fetch_add(to_copy, std::memory_order_relaxed);
  conn->Write(iov, std::move(done), std::move(keep));
}

void EpAddToPollset(grpc_endpoint*, grpc_pollset*) {}
void EpAddToPollsetSet(grpc_endpoint*, grpc_pollset_set*) {}
void EpDeleteFromPollsetSet(grpc_endpoint*, grpc_pollset_set*) {}

void EpShutdown(grpc_endpoint* ep, grpc_error_handle why) {
  State* st = Of(ep);
  GRPC_RDMA_TRACE("%s: shutdown: %s", st->peer.c_str(), why.ToString().c_str());
  if (Release(st,
              absl::UnavailableError(why.ok() ? std::string("endpoint shut down")
                                              : std::string(why.message())),
              /*by_shutdown=*/true)) {
    GlobalCounters().rdma_shut_down_held.fetch_add(1);  // until destroyed: gRPC holds it
  }
}

void EpDestroy(grpc_endpoint* ep) {
  auto* e = reinterpret_cast<RdmaEndpoint*>(ep);
  Release(e->st.get(), absl::UnavailableError("endpoint destroyed"));
  bool was_shut_down;
  {
    // gRPC orders its destroy after its shutdown, with atomics of its own
    // (not instrumented): the lock says so to ThreadSanitizer too.
    std::lock_guard<std::mutex> g(e->st->mu);
    was_shut_down = e->st->shut_down;
  }
  if (was_shut_down) GlobalCounters().rdma_shut_down_held.fetch_sub(1);
  GRPC_RDMA_TRACE("%s: destroyed (%s side)", e->st->peer.c_str(),
                  e->st->server ? "server" : "client");
  delete e;
}

absl::string_view EpPeer(grpc_endpoint* ep) { return Of(ep)->peer; }
absl::string_view EpLocal(grpc_endpoint* ep) { return Of(ep)->local; }
int EpFd(grpc_endpoint*) { return -1; }
bool EpCanTrackErr(grpc_endpoint*) { return false; }

const grpc_endpoint_vtable kVtable = {
    EpRead,     EpWrite, EpAddToPollset, EpAddToPollsetSet, EpDeleteFromPollsetSet,
    EpShutdown, EpDestroy, EpPeer,       EpLocal,           EpFd,
    EpCanTrackErr};

}  // namespace

void RunClosure(grpc_closure* closure, grpc_error_handle error) {
  if (grpc_core::ExecCtx::Get() != nullptr) {
    grpc_core::ExecCtx::Run(DEBUG_LOCATION, closure, std::move(error));
    return;
  }
  grpc_core::ApplicationCallbackExecCtx callback_exec_ctx;
  grpc_core::ExecCtx exec_ctx;
  grpc_core::ExecCtx::Run(DEBUG_LOCATION, closure, std::move(error));
}

grpc_error_handle ToGrpcError(const absl::Status& s) {
  return grpc_error_set_int(
      GRPC_ERROR_CREATE(absl::StrCat("RDMA: ", s.message())),
      grpc_core::StatusIntProperty::kRpcStatus, GRPC_STATUS_UNAVAILABLE);
}

ChunkMemory SliceChunkMemory() { return ChunkMemory{AllocateSlice, ReleaseSlice}; }

grpc_endpoint* CreateRdmaEndpoint(std::shared_ptr<Connection> conn, bool server) {
  auto* e = new RdmaEndpoint;
  e->base.vtable = &kVtable;
  e->st = std::make_shared<State>();
  e->st->peer = GrpcAddress(conn->peer());
  e->st->local = GrpcAddress(conn->local());
  e->st->server = server;
  TrackConnection(conn, &e->st->copies);
  std::string device = conn->device();
  e->st->conn = std::move(conn);
  if (Runtime* rt = Runtime::Get()) {
    rt->AcquirePolling();
    e->st->polling = true;
    e->st->conn_polling = rt->PollConnection(e->st->conn);
  }
  Counters& c = GlobalCounters();
  (server ? c.rdma_server : c.rdma_client).fetch_add(1);
  c.rdma_open.fetch_add(1);
  GRPC_RDMA_TRACE("%s: RDMA connection up (%s side, local %s, device %s)", e->st->peer.c_str(),
                  server ? "server" : "client", e->st->local.c_str(), device.c_str());
  return &e->base;
}

}  // namespace grpc_rdma
