// File: src/engine/flow.h
//
// Flow control of one connection, as a value: the peer's receives we may
// still use (credits), the receives we reposted and owe the peer word of,
// and our send queue's free slots. No verbs, no locks: the connection owns
// one and calls it under its own lock; flow_test.cc tests it without a
// device.
//
// The credit rule (docs/wire-protocol.md): every message we send, data or
// control, takes one of the peer's posted receives. Data needs two credits,
// so one receive always stays for a control message (a credit update or a
// grant), and the two sides can never both wait for credits.
#ifndef GRPC_RDMA_SRC_ENGINE_FLOW_H_
#define GRPC_RDMA_SRC_ENGINE_FLOW_H_

#include <algorithm>
#include <cstdint>

namespace grpc_rdma {

class Flow {
 public:
  // From the peer's Hello (its receives: our credits) and our QP's send
  // queue.
  void Start(int peer_depth, int send_slots) {
    peer_depth_ = peer_depth;
    credits_ = peer_depth;
    send_slots_ = send_slots;
  }
  // A send queue of `slots`, before the peer is known (set-up).
  void SetSendSlots(int slots) { send_slots_ = slots; }

  // Stream data (eager messages, chunks) may go: two credits and a slot.
  bool CanSendData() const { return credits_ >= 2 && send_slots_ > 0; }
  // A control message may go: one credit and a slot.
  bool CanSendControl() const { return credits_ >= 1 && send_slots_ > 0; }
  bool HasSendSlot() const { return send_slots_ > 0; }

  // The peer returned `n` credits with a message. False (and nothing
  // changed) when that is more than it has receives: a protocol violation.
  bool Return(uint32_t n) {
    if (n > static_cast<uint32_t>(peer_depth_) ||
        credits_ + static_cast<int>(n) > peer_depth_)
      return false;
    credits_ += static_cast<int>(n);
    return true;
  }
  // A message of ours was posted: one credit and one slot taken.
  void Sent() {
    --credits_;
    --send_slots_;
  }
  // A send completed (every send is signalled): its slot is free.
  void SendCompleted() { ++send_slots_; }

  // We reposted one of our receives: the peer may use it again once told.
  void Reposted() { ++owed_; }
  // The credits to put in the header of the message about to be posted.
  uint16_t owed() const { return static_cast<uint16_t>(std::min(owed_, 0xffff)); }
  // That message is posted: the peer knows of them.
  void Told(uint16_t n) { owed_ -= std::min<int>(n, owed_); }

  // Nothing else to say, and enough owed that the peer may be waiting for
  // them: a credit update of its own is worth a message. `our_depth` is our
  // receives (TF_RDMA_EAGER_DEPTH).
  bool UpdateDue(int our_depth) const {
    return CanSendControl() && owed_ >= std::max(2, our_depth / 4);
  }

  // Standing grants (held until the peer uses them) take at most half of
  // the peer's receives: more than half must be free to make one.
  bool RoomForStandingGrant() const {
    return credits_ > std::max(2, peer_depth_ / 2) && send_slots_ > 0;
  }

  int credits() const { return credits_; }
  int peer_depth() const { return peer_depth_; }
  int send_slots() const { return send_slots_; }

 private:
  int peer_depth_ = 0;
  int credits_ = 0;
  int owed_ = 0;
  int send_slots_ = 0;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_FLOW_H_
