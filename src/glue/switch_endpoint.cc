// The endpoint that starts on TCP and moves to RDMA (switch_endpoint.h says
// how). All its state is in Switch, under Switch::mu; calls into the inner
// endpoints are made without it (their callbacks may run on the calling
// thread), except the header's write, which must be queued on the RDMA
// connection before any write of gRPC's that follows it.
#include "glue/switch_endpoint.h"

#include <grpc/slice.h>
#include <grpc/slice_buffer.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "glue/endpoint.h"
#include "glue/stats.h"
#include "glue/trace.h"
#include "src/core/lib/iomgr/closure.h"
#include "src/core/lib/iomgr/exec_ctx.h"

namespace grpc_rdma {

struct Switch : std::enable_shared_from_this<Switch> {
  std::mutex mu;
  grpc_endpoint* tcp = nullptr;   // null once destroyed
  grpc_endpoint* rdma = nullptr;  // once attached; null once destroyed
  bool server = false;
  std::string peer, local, tcp_peer;
  // gRPC shut the endpoint down (its reads and writes fail from then) or
  // destroyed it (then nothing more comes from gRPC).
  bool shut_down = false;
  bool destroyed = false;
  grpc_error_handle shutdown_error;
  int calls_out = 0;  // calls into the inner endpoints under way without mu
  // Runs once when the endpoint goes (shut down, destroyed or failed)
  // before an RDMA connection joined: the client cancels its connect.
  std::function<void()> on_gone;
  // Runs once if the RDMA connection is dropped before this side's writes
  // moved (the peer refused the join, or is no switch): the client notes
  // the address as one without RDMA, as for any fallback.
  std::function<void()> on_dropped;
  bool inner_gone = false;  // the inner endpoints were destroyed
  // A fault that ends the endpoint (the peer broke the switch's protocol).
  grpc_error_handle fatal;

  // The join token. A client's: its frame, until gRPC's first write takes
  // it. A server's: the TCP stream's first bytes, until they say what the
  // stream carries, and what to tell then.
  std::string join_frame;
  std::string head;
  std::function<void(StreamHead, std::string)> on_head;

  // Writing.
  uint64_t tcp_written = 0;     // bytes written on TCP (a token's frame among them)
  bool tcp_write_pending = false;
  bool writes_rdma = false;     // the header went out: writes go by RDMA
  grpc_closure* write_cb = nullptr;  // gRPC's, for the TCP write in flight
  grpc_closure tcp_write_done;
  grpc_slice_buffer header;     // the header written (kept until its write is done)
  grpc_closure header_done;

  // Reading.
  uint64_t tcp_read = 0;        // bytes read from TCP
  grpc_slice_buffer tcp_in;     // the TCP read's buffer
  grpc_slice_buffer tcp_ready;  // read from TCP, not yet handed to gRPC
  bool tcp_read_pending = false;
  grpc_closure tcp_read_done;
  grpc_error_handle tcp_error;  // the TCP read failed (ok: it did not)
  bool tcp_failed = false;
  grpc_slice_buffer rdma_in;    // the RDMA read's buffer, until the header is in
  grpc_slice_buffer rdma_head;  // RDMA bytes gathered until the header is whole
  grpc_slice_buffer rdma_ready; // RDMA bytes after the header, not yet handed up
  bool rdma_read_pending = false;
  grpc_closure rdma_read_done;
  bool rdma_failed = false;     // the RDMA connection failed before its header came
  int64_t tcp_limit = -1;       // the peer's N: its TCP stream's length (-1: unknown)
  bool reads_rdma = false;      // all N TCP bytes handed up: reads go by RDMA
  grpc_slice_buffer* read_slices = nullptr;  // gRPC's pending read, if any
  grpc_closure* read_cb = nullptr;
  bool read_urgent = false;
  int read_min_progress = 1;

  // Self-references held while an inner call's callback is owed.
  std::shared_ptr<Switch> hold_tcp_read, hold_tcp_write, hold_rdma_read, hold_header;

  Switch() {
    grpc_slice_buffer_init(&header);
    grpc_slice_buffer_init(&tcp_in);
    grpc_slice_buffer_init(&tcp_ready);
    grpc_slice_buffer_init(&rdma_in);
    grpc_slice_buffer_init(&rdma_head);
    grpc_slice_buffer_init(&rdma_ready);
  }
  ~Switch() {
    grpc_slice_buffer_destroy(&header);
    grpc_slice_buffer_destroy(&tcp_in);
    grpc_slice_buffer_destroy(&tcp_ready);
    grpc_slice_buffer_destroy(&rdma_in);
    grpc_slice_buffer_destroy(&rdma_head);
    grpc_slice_buffer_destroy(&rdma_ready);
  }
};

namespace {

struct SwitchEndpoint {
  grpc_endpoint base;  // first: gRPC hands back this pointer
  std::shared_ptr<Switch> sw;
};

Switch* Of(grpc_endpoint* ep) { return reinterpret_cast<SwitchEndpoint*>(ep)->sw.get(); }

grpc_error_handle SwitchError(absl::string_view what) {
  return grpc_error_set_int(GRPC_ERROR_CREATE(absl::StrCat("TCP to RDMA switch: ", what)),
                            grpc_core::StatusIntProperty::kRpcStatus, GRPC_STATUS_UNAVAILABLE);
}

// What a step decided, done once mu is let go.
struct Actions {
  grpc_closure* complete = nullptr;  // gRPC's read callback to run
  grpc_error_handle complete_error;
  bool start_tcp_read = false;
  bool tcp_urgent = false;
  int tcp_min_progress = 1;
  bool start_rdma_read = false;
  // gRPC's read, handed to the RDMA endpoint as it is.
  grpc_slice_buffer* forward_slices = nullptr;
  grpc_closure* forward_cb = nullptr;
  bool forward_urgent = false;
  int forward_min_progress = 1;
  grpc_endpoint* tcp = nullptr;
  grpc_endpoint* rdma = nullptr;
  // The RDMA connection is of no use (its peer is no switch, or it ended
  // before the peer's header): shut it down; the endpoint stays on TCP.
  grpc_endpoint* drop_rdma = nullptr;
  // A fault ended the endpoint: both inner endpoints are shut down, so
  // reads pending on them end.
  grpc_endpoint* fail_tcp = nullptr;
  grpc_endpoint* fail_rdma = nullptr;
  std::function<void()> gone;  // Switch::on_gone, to run
  std::function<void()> dropped;  // Switch::on_dropped, to run
  std::function<void()> head_read;  // Switch::on_head, with what the head said
};

// Under mu: the header goes out on the RDMA connection and writes follow
// it there. Written under mu so that no write of gRPC's can pass it; its
// completion takes no lock. The caller has an ExecCtx, so no callback of
// the RDMA endpoint runs inside this call (RunClosure defers to it).
void SendHeaderLocked(Switch* s) {
  GPR_DEBUG_ASSERT(grpc_core::ExecCtx::Get() != nullptr);
  s->writes_rdma = true;
  char h[kSwitchHeaderBytes];
  for (int i = 0; i < 8; ++i) h[i] = static_cast<char>(kSwitchMagic >> (8 * i));
  for (int i = 0; i < 8; ++i) h[8 + i] = static_cast<char>(s->tcp_written >> (8 * i));
  grpc_slice_buffer_add(&s->header, grpc_slice_from_copied_buffer(h, sizeof(h)));
  s->hold_header = s->shared_from_this();
  if (!s->server) GlobalCounters().tcp_first_moved.fetch_add(1);
  GRPC_RDMA_TRACE("%s: writes move to RDMA after %llu bytes on TCP (%s side)", s->peer.c_str(),
                  static_cast<unsigned long long>(s->tcp_written),
                  s->server ? "server" : "client");
  grpc_endpoint_write(s->rdma, &s->header, &s->header_done, nullptr, INT_MAX);
}

// Under mu: whether this side's writes move to RDMA now. Not while a TCP
// write is in flight (its bytes must all be counted in N). The server
// moves at once; the client only once the server's header came, which
// says the server joined the RDMA connection to this TCP connection: a
// server that refused the join, or one that does not join (an older
// grpc-rdma), leaves the client's writes on TCP.
bool WritesMayMoveLocked(const Switch* s) {
  return s->rdma != nullptr && !s->writes_rdma && !s->tcp_write_pending && !s->rdma_failed &&
         s->fatal.ok() && !s->shut_down && !s->destroyed && (s->server || s->tcp_limit >= 0);
}

// Under mu: the endpoint fails with `error` (the peer broke the switch's
// protocol); both inner endpoints are shut down once mu is let go.
void FailLocked(Switch* s, grpc_error_handle error, Actions* a) {
  if (!s->fatal.ok()) return;
  s->fatal = error;
  GRPC_RDMA_TRACE("%s: %s", s->peer.c_str(), grpc_core::StatusToString(error).c_str());
  if (!s->destroyed) {
    a->fail_tcp = s->tcp;
    a->fail_rdma = s->rdma;
    if (a->fail_tcp != nullptr || a->fail_rdma != nullptr) ++s->calls_out;
  }
}

// Under mu: the RDMA connection is given up before this side's writes
// moved; the endpoint goes on over TCP.
void DropRdmaLocked(Switch* s, const char* why, Actions* a) {
  s->rdma_failed = true;
  GRPC_RDMA_TRACE("%s: %s: the connection stays on TCP (%s side)", s->peer.c_str(), why,
                  s->server ? "server" : "client");
  if (s->rdma != nullptr && !s->destroyed && a->drop_rdma == nullptr) {
    a->drop_rdma = s->rdma;
    ++s->calls_out;
  }
  a->dropped = std::move(s->on_dropped);
  s->on_dropped = nullptr;
}

// Under mu: what to do next for gRPC's read and the inner reads.
void StepLocked(Switch* s, Actions* a) {
  // The read direction moves once every byte the peer wrote on TCP is up.
  if (!s->reads_rdma && s->tcp_limit >= 0 && s->tcp_ready.length == 0 &&
      s->tcp_read == static_cast<uint64_t>(s->tcp_limit)) {
    s->reads_rdma = true;
    GRPC_RDMA_TRACE("%s: reads move to RDMA after %llu bytes on TCP (%s side)",
                    s->peer.c_str(), static_cast<unsigned long long>(s->tcp_read),
                    s->server ? "server" : "client");
  }
  if (s->read_cb != nullptr) {
    grpc_error_handle error;
    bool done = false;
    if (!s->fatal.ok()) {
      error = s->fatal;
      done = true;
    } else if (s->shut_down) {
      error = s->shutdown_error;
      done = true;
    } else if (!s->reads_rdma) {
      if (s->tcp_ready.length > 0) {
        grpc_slice_buffer_move_into(&s->tcp_ready, s->read_slices);
        done = true;
      } else if (s->tcp_failed &&
                 (s->rdma == nullptr || s->rdma_failed || s->tcp_limit >= 0)) {
        // No header can tell that TCP ended where it should have: the
        // stream broke.
        error = s->tcp_error;
        done = true;
      }
    } else if (s->rdma_ready.length > 0) {
      grpc_slice_buffer_move_into(&s->rdma_ready, s->read_slices);
      done = true;
    } else {
      a->forward_slices = s->read_slices;
      a->forward_cb = s->read_cb;
      a->forward_urgent = s->read_urgent;
      a->forward_min_progress = s->read_min_progress;
      a->rdma = s->rdma;
      s->read_slices = nullptr;
      s->read_cb = nullptr;
    }
    if (done) {
      if (!error.ok()) grpc_slice_buffer_reset_and_unref(s->read_slices);
      a->complete = s->read_cb;
      a->complete_error = error;
      s->read_slices = nullptr;
      s->read_cb = nullptr;
    }
  }
  bool usable = !s->destroyed && !s->shut_down && s->fatal.ok();
  // TCP is read while gRPC waits on it (as its own endpoint reads).
  if (usable && s->read_cb != nullptr && !s->reads_rdma && s->tcp_ready.length == 0 &&
      !s->tcp_read_pending && !s->tcp_failed) {
    s->tcp_read_pending = true;
    s->hold_tcp_read = s->shared_from_this();
    a->start_tcp_read = true;
    // One byte is progress: tcp_posix may otherwise hold a read for more
    // bytes than TCP will ever bring, once the rest moved to RDMA.
    a->tcp_urgent = s->read_urgent;
    a->tcp_min_progress = 1;
    a->tcp = s->tcp;
  }
  // The RDMA connection is read for its header as soon as it is attached.
  if (usable && s->rdma != nullptr && s->tcp_limit < 0 && !s->rdma_failed &&
      !s->rdma_read_pending) {
    s->rdma_read_pending = true;
    s->hold_rdma_read = s->shared_from_this();
    a->start_rdma_read = true;
    a->rdma = s->rdma;
  }
  if (a->start_tcp_read || a->start_rdma_read || a->forward_cb != nullptr) ++s->calls_out;
}

// Shut down first: a TCP endpoint destroyed with a read pending keeps its
// socket until that read completes, and the idle TCP connection's read
// would complete only when the peer closes.
void DestroyInner(grpc_endpoint* tcp, grpc_endpoint* rdma) {
  for (grpc_endpoint* ep : {tcp, rdma}) {
    if (ep == nullptr) continue;
    grpc_endpoint_shutdown(ep, SwitchError("endpoint destroyed"));
    grpc_endpoint_destroy(ep);
  }
}

// Without mu: does what StepLocked decided.
void Run(Switch* s, Actions* a) {
  bool called = a->start_tcp_read || a->start_rdma_read || a->forward_cb != nullptr;
  int extra_calls = 0;
  if (a->dropped) a->dropped();  // counted before the connection is seen closed
  if (a->drop_rdma != nullptr) {
    grpc_endpoint_shutdown(a->drop_rdma, SwitchError("the RDMA connection is not used"));
    ++extra_calls;
  }
  if (a->fail_tcp != nullptr || a->fail_rdma != nullptr) {
    if (a->fail_tcp != nullptr) grpc_endpoint_shutdown(a->fail_tcp, SwitchError("failed"));
    if (a->fail_rdma != nullptr) grpc_endpoint_shutdown(a->fail_rdma, SwitchError("failed"));
    ++extra_calls;
  }
  if (a->gone) a->gone();
  if (a->start_tcp_read) {
    grpc_endpoint_read(a->tcp, &s->tcp_in, &s->tcp_read_done, a->tcp_urgent,
                       a->tcp_min_progress);
  }
  if (a->start_rdma_read) {
    grpc_endpoint_read(a->rdma, &s->rdma_in, &s->rdma_read_done, false, 1);
  }
  if (a->forward_cb != nullptr) {
    grpc_endpoint_read(a->rdma, a->forward_slices, a->forward_cb, a->forward_urgent,
                       a->forward_min_progress);
  }
  if (called || extra_calls > 0) {
    grpc_endpoint *tcp = nullptr, *rdma = nullptr;
    {
      std::lock_guard<std::mutex> g(s->mu);
      s->calls_out -= (called ? 1 : 0) + extra_calls;
      if (s->calls_out == 0 && s->destroyed && !s->inner_gone) {
        s->inner_gone = true;
        tcp = std::exchange(s->tcp, nullptr);
        rdma = std::exchange(s->rdma, nullptr);
      }
    }
    DestroyInner(tcp, rdma);
  }
  if (a->head_read) a->head_read();
  if (a->complete != nullptr) RunClosure(a->complete, a->complete_error);
}

// Under mu, a server's: the TCP bytes just read, looked at until the
// stream's head says whether it carries a join token.
void ReadHeadLocked(Switch* s, const grpc_slice_buffer& in, Actions* a) {
  for (size_t i = 0; i < in.count && s->head.size() < kMaxStreamHead; ++i) {
    const char* p = reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(in.slices[i]));
    size_t n = std::min(GRPC_SLICE_LENGTH(in.slices[i]), kMaxStreamHead - s->head.size());
    s->head.append(p, n);
  }
  std::string token;
  StreamHead h = ReadStreamHead(s->head, &token);
  if (h == StreamHead::kNeedMore && s->head.size() < kMaxStreamHead) return;
  if (h == StreamHead::kNeedMore) h = StreamHead::kNoToken;  // not reached: the bound fits
  std::function<void(StreamHead, std::string)> fn = std::move(s->on_head);
  s->on_head = nullptr;
  std::string().swap(s->head);
  if (h == StreamHead::kNotPlaintext) {
    GRPC_RDMA_TRACE("%s: the TCP stream is not plaintext HTTP/2 (TLS?): an RDMA connection "
                    "may join it by address alone",
                    s->peer.c_str());
  } else if (h == StreamHead::kNoToken) {
    GRPC_RDMA_TRACE("%s: the TCP stream carries no join token: no RDMA connection joins it",
                    s->peer.c_str());
  }
  a->head_read = [fn, h, token] { fn(h, token); };
}

void OnTcpRead(void* arg, grpc_error_handle error) {
  Switch* s = static_cast<Switch*>(arg);
  std::shared_ptr<Switch> keep;
  Actions a;
  {
    std::lock_guard<std::mutex> g(s->mu);
    keep = std::move(s->hold_tcp_read);
    s->tcp_read_pending = false;
    if (error.ok()) {
      size_t n = s->tcp_in.length;
      s->tcp_read += n;
      if (s->reads_rdma || (s->tcp_limit >= 0 && s->tcp_read > static_cast<uint64_t>(s->tcp_limit))) {
        if (n > 0) {
          FailLocked(s, SwitchError(absl::StrCat(
                            "the peer wrote ", s->tcp_read,
                            " bytes on TCP after saying its TCP stream ends at ", s->tcp_limit)),
                     &a);
        }
        grpc_slice_buffer_reset_and_unref(&s->tcp_in);
      } else {
        if (s->on_head) ReadHeadLocked(s, s->tcp_in, &a);
        grpc_slice_buffer_move_into(&s->tcp_in, &s->tcp_ready);
      }
    } else {
      s->on_head = nullptr;  // the stream ended before its head said anything
      grpc_slice_buffer_reset_and_unref(&s->tcp_in);
      // After the switch the idle TCP connection may end (the peer went):
      // the RDMA connection says how the stream ends.
      if (!s->reads_rdma) {
        s->tcp_failed = true;
        s->tcp_error = error;
      }
    }
    StepLocked(s, &a);
  }
  Run(s, &a);
}

void OnRdmaHeaderRead(void* arg, grpc_error_handle error) {
  Switch* s = static_cast<Switch*>(arg);
  std::shared_ptr<Switch> keep;
  Actions a;
  {
    std::lock_guard<std::mutex> g(s->mu);
    keep = std::move(s->hold_rdma_read);
    s->rdma_read_pending = false;
    if (!error.ok()) {
      grpc_slice_buffer_reset_and_unref(&s->rdma_in);
      if (s->writes_rdma) {
        // Ours went by RDMA (a server's, from the join on), perhaps lost
        // with it: the connection fails, as any whose transport broke.
        FailLocked(s, SwitchError("the RDMA connection ended before the peer's header"), &a);
      } else {
        // Nothing went by RDMA either way: the peer's writes are still on
        // TCP, and so are ours. The RDMA connection is let go.
        DropRdmaLocked(s, "the RDMA connection ended before the peer's header", &a);
      }
    } else if (s->destroyed || s->shut_down) {
      grpc_slice_buffer_reset_and_unref(&s->rdma_in);
    } else {
      grpc_slice_buffer_move_into(&s->rdma_in, &s->rdma_head);
      if (s->rdma_head.length >= kSwitchHeaderBytes) {
        char h[kSwitchHeaderBytes];
        grpc_slice_buffer_move_first_into_buffer(&s->rdma_head, sizeof(h), h);
        uint64_t magic = 0, n = 0;
        for (int i = 7; i >= 0; --i) magic = (magic << 8) | static_cast<uint8_t>(h[i]);
        for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(h[8 + i]);
        if (magic != kSwitchMagic || n > (uint64_t{1} << 62)) {
          if (!s->writes_rdma) {
            // Nothing of ours went by RDMA: the peer is no switch (a server
            // that took the connection for a transport of its own).
            grpc_slice_buffer_reset_and_unref(&s->rdma_head);
            DropRdmaLocked(s, "the peer's RDMA stream does not start with the switch's header",
                           &a);
          } else {
            FailLocked(s, SwitchError("the peer's RDMA stream does not start with the switch's "
                                      "header"),
                       &a);
          }
        } else if (s->tcp_read > n) {
          FailLocked(s, SwitchError(absl::StrCat("the peer says its TCP stream ends at ", n,
                                                 " bytes and ", s->tcp_read, " came")),
                     &a);
        } else {
          s->tcp_limit = static_cast<int64_t>(n);
          grpc_slice_buffer_move_into(&s->rdma_head, &s->rdma_ready);
          if (WritesMayMoveLocked(s)) SendHeaderLocked(s);
        }
      }
    }
    StepLocked(s, &a);
  }
  Run(s, &a);
}

void OnTcpWrite(void* arg, grpc_error_handle error) {
  Switch* s = static_cast<Switch*>(arg);
  std::shared_ptr<Switch> keep;
  grpc_closure* cb;
  {
    std::lock_guard<std::mutex> g(s->mu);
    keep = std::move(s->hold_tcp_write);
    s->tcp_write_pending = false;
    cb = std::exchange(s->write_cb, nullptr);
    // The first moment no TCP write is in flight with RDMA there.
    if (error.ok() && WritesMayMoveLocked(s)) SendHeaderLocked(s);
  }
  grpc_core::ExecCtx::Run(DEBUG_LOCATION, cb, error);
}

void OnHeaderWritten(void* arg, grpc_error_handle /*error*/) {
  // A failure shows in the writes that follow on the same connection.
  // Never inline in SendHeaderLocked (its caller's ExecCtx defers this),
  // so mu is free here.
  Switch* s = static_cast<Switch*>(arg);
  std::shared_ptr<Switch> keep;
  std::lock_guard<std::mutex> g(s->mu);
  keep = std::move(s->hold_header);
}

void EpRead(grpc_endpoint* ep, grpc_slice_buffer* slices, grpc_closure* cb, bool urgent,
            int min_progress_size) {
  grpc_slice_buffer_reset_and_unref(slices);
  Switch* s = Of(ep);
  Actions a;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->reads_rdma && s->rdma_ready.length == 0 && s->fatal.ok() && !s->shut_down) {
      // Moved: straight to the RDMA endpoint.
      a.forward_slices = slices;
      a.forward_cb = cb;
      a.forward_urgent = urgent;
      a.forward_min_progress = min_progress_size;
      a.rdma = s->rdma;
      ++s->calls_out;
    } else {
      s->read_slices = slices;
      s->read_cb = cb;
      s->read_urgent = urgent;
      s->read_min_progress = min_progress_size;
      StepLocked(s, &a);
    }
  }
  Run(s, &a);
}

// Under mu, a client's first write on TCP: the token's frame goes in (see
// InsertJoinFrame).
void InsertJoinFrameLocked(Switch* s, grpc_slice_buffer* slices) {
  std::string frame = std::move(s->join_frame);
  s->join_frame.clear();
  if (!InsertJoinFrame(slices, frame)) {
    GRPC_RDMA_TRACE("%s: the first TCP write is not HTTP/2's preface and SETTINGS (TLS?): no "
                    "join token in the stream",
                    s->peer.c_str());
  }
}

void EpWrite(grpc_endpoint* ep, grpc_slice_buffer* slices, grpc_closure* cb, void* arg,
             int max_frame_size) {
  Switch* s = Of(ep);
  grpc_endpoint* target;
  bool tcp;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (!s->fatal.ok() || s->shut_down) {
      grpc_error_handle e = !s->fatal.ok() ? s->fatal : s->shutdown_error;
      grpc_core::ExecCtx::Run(DEBUG_LOCATION, cb, e);
      return;
    }
    tcp = !s->writes_rdma;
    target = tcp ? s->tcp : s->rdma;
    if (tcp && !s->join_frame.empty()) InsertJoinFrameLocked(s, slices);
    if (tcp) {
      s->tcp_written += slices->length;
      s->tcp_write_pending = true;
      s->write_cb = cb;
      s->hold_tcp_write = s->shared_from_this();
    }
  }
  // gRPC makes one write at a time and never one with its destroy.
  if (tcp) {
    grpc_endpoint_write(target, slices, &s->tcp_write_done, arg, max_frame_size);
  } else {
    grpc_endpoint_write(target, slices, cb, arg, max_frame_size);
  }
}

void EpAddToPollset(grpc_endpoint* ep, grpc_pollset* pollset) {
  grpc_endpoint_add_to_pollset(Of(ep)->tcp, pollset);
}
void EpAddToPollsetSet(grpc_endpoint* ep, grpc_pollset_set* set) {
  grpc_endpoint_add_to_pollset_set(Of(ep)->tcp, set);
}
void EpDeleteFromPollsetSet(grpc_endpoint* ep, grpc_pollset_set* set) {
  grpc_endpoint_delete_from_pollset_set(Of(ep)->tcp, set);
}

void EpShutdown(grpc_endpoint* ep, grpc_error_handle why) {
  Switch* s = Of(ep);
  grpc_endpoint *tcp, *rdma;
  Actions a;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->shut_down) return;
    s->shut_down = true;
    s->shutdown_error = why.ok() ? SwitchError("endpoint shut down") : why;
    tcp = s->tcp;
    rdma = s->rdma;
    ++s->calls_out;
    if (rdma == nullptr) a.gone = std::move(s->on_gone);
    s->on_gone = nullptr;
    StepLocked(s, &a);
  }
  // gRPC calls no destroy during its own shutdown: the pointers hold.
  grpc_endpoint_shutdown(tcp, why);
  if (rdma != nullptr) grpc_endpoint_shutdown(rdma, why);
  {
    std::lock_guard<std::mutex> g(s->mu);
    --s->calls_out;
  }
  Run(s, &a);
}

void EpDestroy(grpc_endpoint* ep) {
  auto* e = reinterpret_cast<SwitchEndpoint*>(ep);
  Switch* s = e->sw.get();
  grpc_endpoint *tcp = nullptr, *rdma = nullptr;
  grpc_closure* read_cb;
  std::function<void()> gone;
  bool moved;
  {
    std::lock_guard<std::mutex> g(s->mu);
    s->destroyed = true;
    read_cb = std::exchange(s->read_cb, nullptr);
    if (read_cb != nullptr) grpc_slice_buffer_reset_and_unref(s->read_slices);
    s->read_slices = nullptr;
    if (s->rdma == nullptr) gone = std::move(s->on_gone);
    s->on_gone = nullptr;
    moved = s->writes_rdma || s->reads_rdma;
    if (s->calls_out == 0) {
      s->inner_gone = true;
      tcp = std::exchange(s->tcp, nullptr);
      rdma = std::exchange(s->rdma, nullptr);
    }
  }
  GRPC_RDMA_TRACE("%s: destroyed (%s side, %s)", s->peer.c_str(),
                  s->server ? "server" : "client", moved ? "moved to RDMA" : "on TCP");
  if (gone) gone();
  if (read_cb != nullptr) RunClosure(read_cb, SwitchError("endpoint destroyed"));
  // Reads still pending on them complete (with errors) and let go of s.
  DestroyInner(tcp, rdma);
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

namespace {
constexpr absl::string_view kPreface("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24);
constexpr size_t kFrameHeader = 9;
constexpr uint8_t kSettings = 4;

// An HTTP/2 frame header at `p`: its payload length, type and stream.
void FrameHeaderAt(const char* p, uint32_t* len, uint8_t* type, uint32_t* stream) {
  auto b = [p](int i) { return static_cast<uint32_t>(static_cast<uint8_t>(p[i])); };
  *len = (b(0) << 16) | (b(1) << 8) | b(2);
  *type = static_cast<uint8_t>(b(3));
  *stream = ((b(5) << 24) | (b(6) << 16) | (b(7) << 8) | b(8)) & 0x7fffffffu;
}
}  // namespace

std::string JoinFrame(absl::string_view token) {
  std::string f(kFrameHeader, '\0');
  f[2] = static_cast<char>(8 + kJoinTokenBytes);
  f[3] = static_cast<char>(kJoinFrameType);
  f.append(kJoinFrameLabel, 8);
  f.append(token.data(), std::min(token.size(), kJoinTokenBytes));
  f.resize(kJoinFrameBytes, '\0');
  return f;
}

size_t JoinFrameOffset(absl::string_view head) {
  if (head.size() < kPreface.size() + kFrameHeader || head.substr(0, kPreface.size()) != kPreface) {
    return 0;
  }
  uint32_t len, stream;
  uint8_t type;
  FrameHeaderAt(head.data() + kPreface.size(), &len, &type, &stream);
  if (type != kSettings || stream != 0 || len > kMaxStreamHead - 24 - 9 - kJoinFrameBytes) {
    return 0;
  }
  return kPreface.size() + kFrameHeader + len;
}

bool InsertJoinFrame(grpc_slice_buffer* slices, absl::string_view frame) {
  char head[kPreface.size() + kFrameHeader];
  size_t n = 0;
  for (size_t i = 0; i < slices->count && n < sizeof(head); ++i) {
    size_t k = std::min(GRPC_SLICE_LENGTH(slices->slices[i]), sizeof(head) - n);
    memcpy(head + n, GRPC_SLICE_START_PTR(slices->slices[i]), k);
    n += k;
  }
  size_t at = JoinFrameOffset(absl::string_view(head, n));
  if (at == 0 || at > slices->length) return false;
  grpc_slice_buffer rest;
  grpc_slice_buffer_init(&rest);
  grpc_slice_buffer_swap(slices, &rest);
  grpc_slice_buffer_move_first(&rest, at, slices);
  grpc_slice_buffer_add(slices, grpc_slice_from_copied_buffer(frame.data(), frame.size()));
  grpc_slice_buffer_move_into(&rest, slices);
  grpc_slice_buffer_destroy(&rest);
  return true;
}

StreamHead ReadStreamHead(absl::string_view head, std::string* token) {
  size_t n = std::min(head.size(), kPreface.size());
  if (head.substr(0, n) != kPreface.substr(0, n)) return StreamHead::kNotPlaintext;
  if (head.size() < kPreface.size() + kFrameHeader) return StreamHead::kNeedMore;
  size_t at = JoinFrameOffset(head);
  if (at == 0) return StreamHead::kNoToken;  // not SETTINGS first, or one too large
  if (head.size() < at + kFrameHeader) return StreamHead::kNeedMore;
  uint32_t len, stream;
  uint8_t type;
  FrameHeaderAt(head.data() + at, &len, &type, &stream);
  if (type != kJoinFrameType || len != 8 + kJoinTokenBytes || stream != 0) {
    return StreamHead::kNoToken;
  }
  if (head.size() < at + kJoinFrameBytes) return StreamHead::kNeedMore;
  if (head.substr(at + kFrameHeader, 8) != absl::string_view(kJoinFrameLabel, 8)) {
    return StreamHead::kNoToken;
  }
  *token = std::string(head.substr(at + kFrameHeader + 8, kJoinTokenBytes));
  return StreamHead::kToken;
}

std::string Ipv4HostPort(absl::string_view a) {
  constexpr absl::string_view kIpv4 = "ipv4:";
  if (a.substr(0, kIpv4.size()) != kIpv4) return "";
  a.remove_prefix(kIpv4.size());
  a = a.substr(0, a.find('?'));
  return std::string(a);
}

std::shared_ptr<Switch> CreateSwitchEndpoint(grpc_endpoint* tcp, bool server,
                                             grpc_endpoint** out) {
  auto s = std::make_shared<Switch>();
  s->tcp = tcp;
  s->server = server;
  s->peer = std::string(grpc_endpoint_get_peer(tcp));
  s->local = std::string(grpc_endpoint_get_local_address(tcp));
  s->tcp_peer = Ipv4HostPort(s->peer);
  GRPC_CLOSURE_INIT(&s->tcp_read_done, OnTcpRead, s.get(), nullptr);
  GRPC_CLOSURE_INIT(&s->tcp_write_done, OnTcpWrite, s.get(), nullptr);
  GRPC_CLOSURE_INIT(&s->rdma_read_done, OnRdmaHeaderRead, s.get(), nullptr);
  GRPC_CLOSURE_INIT(&s->header_done, OnHeaderWritten, s.get(), nullptr);
  auto* e = new SwitchEndpoint;
  e->base.vtable = &kVtable;
  e->sw = s;
  *out = &e->base;
  return s;
}

bool SwitchGone(const std::shared_ptr<Switch>& sw) {
  std::lock_guard<std::mutex> g(sw->mu);
  return sw->rdma != nullptr || sw->destroyed || sw->shut_down || !sw->fatal.ok();
}

bool AttachRdma(const std::shared_ptr<Switch>& sw, std::shared_ptr<Connection> conn) {
  Switch* s = sw.get();
  // An endpoint made for nothing would count as an RDMA connection.
  if (SwitchGone(sw)) {
    conn->Shutdown(absl::UnavailableError("the TCP connection it joins is closed"));
    return false;
  }
  grpc_endpoint* rdma = CreateRdmaEndpoint(std::move(conn), s->server);
  Actions a;
  {
    std::lock_guard<std::mutex> g(s->mu);
    if (s->rdma == nullptr && !s->destroyed && !s->shut_down && s->fatal.ok()) {
      s->rdma = rdma;
      rdma = nullptr;
      GRPC_RDMA_TRACE("%s: RDMA connection joined the TCP connection (%s side)", s->peer.c_str(),
                      s->server ? "server" : "client");
      s->on_gone = nullptr;
      if (WritesMayMoveLocked(s)) SendHeaderLocked(s);  // the server's: its join said so
      StepLocked(s, &a);
    }
  }
  if (rdma != nullptr) {  // not taken: destroyed without mu, which shuts it down
    grpc_endpoint_destroy(rdma);
    return false;
  }
  Run(s, &a);
  return true;
}

void SendJoinToken(const std::shared_ptr<Switch>& sw, std::string token) {
  std::lock_guard<std::mutex> g(sw->mu);
  sw->join_frame = JoinFrame(token);
}

void OnStreamHead(const std::shared_ptr<Switch>& sw,
                  std::function<void(StreamHead, std::string)> fn) {
  std::lock_guard<std::mutex> g(sw->mu);
  sw->on_head = std::move(fn);
}

void SetOnDropped(const std::shared_ptr<Switch>& sw, std::function<void()> fn) {
  std::lock_guard<std::mutex> g(sw->mu);
  sw->on_dropped = std::move(fn);
}

void SetOnGone(const std::shared_ptr<Switch>& sw, std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> g(sw->mu);
    if (!sw->destroyed && !sw->shut_down && sw->fatal.ok() && sw->rdma == nullptr) {
      sw->on_gone = std::move(fn);
      return;
    }
  }
  fn();
}

std::string SwitchTcpPeer(const std::shared_ptr<Switch>& sw) { return sw->tcp_peer; }

SwitchProgress ProgressOf(const std::shared_ptr<Switch>& sw) {
  std::lock_guard<std::mutex> g(sw->mu);
  SwitchProgress p;
  p.writes_rdma = sw->writes_rdma;
  p.reads_rdma = sw->reads_rdma;
  p.tcp_written = sw->tcp_written;
  p.tcp_read = sw->tcp_read;
  return p;
}

}  // namespace grpc_rdma
