// File: src/engine/deferred.h
//
// Callbacks collected while a lock is held, run after it is dropped, in
// the order they were added.
//
// Steady traffic adds one write's or one read's completion per message.
// Those are kept as (callback, result) pairs, moved in and moved out, so
// that a message's completion allocates nothing: a lambda around a
// std::function copies that function (and its state) onto the heap, and a
// std::function holding such a lambda allocates once more. The first few
// entries live inside the object (most passes add one or two).
#ifndef GRPC_RDMA_SRC_ENGINE_DEFERRED_H_
#define GRPC_RDMA_SRC_ENGINE_DEFERRED_H_

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace grpc_rdma {

class Deferred {
 public:
  Deferred() = default;
  Deferred(const Deferred&) = delete;
  Deferred& operator=(const Deferred&) = delete;

  // Anything else: a call, or an object to destroy once the locks are
  // dropped (a lambda that captures it and does nothing).
  void push_back(std::function<void()> f) {
    calls_.emplace_back();
    calls_.back().f = std::move(f);
  }
  // `cb(s)`, later.
  void Done(Connection::WriteDone cb, absl::Status s) {
    calls_.emplace_back();
    calls_.back().write = std::move(cb);
    calls_.back().status = std::move(s);
  }
  // `cb(std::move(r))`, later.
  void Deliver(Connection::ReadDone cb, absl::StatusOr<RecvChunks> r) {
    calls_.emplace_back();
    calls_.back().read = std::move(cb);
    calls_.back().result = std::move(r);
  }

  bool empty() const { return calls_.empty(); }
  size_t size() const { return calls_.size(); }

  // Runs each call once, in order, and forgets them all (their captures
  // are destroyed here too).
  void Run() {
    for (Call& c : calls_) {
      if (c.write) {
        c.write(std::move(c.status));
      } else if (c.read) {
        c.read(std::move(c.result));
      } else if (c.f) {
        c.f();
      }
    }
    calls_.clear();
  }

 private:
  struct Call {
    std::function<void()> f;
    Connection::WriteDone write;
    absl::Status status;
    Connection::ReadDone read;
    absl::StatusOr<RecvChunks> result;
  };
  absl::InlinedVector<Call, 4> calls_;
};

// A write's `keep` (references on its buffers: Connection::Write), let go
// once the locks are dropped, since letting go may run the writer's code;
// nothing when null.
inline void LetGo(std::shared_ptr<const void> keep, Deferred* d) {
  if (keep) d->push_back([k = std::move(keep)] {});
}

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_DEFERRED_H_
