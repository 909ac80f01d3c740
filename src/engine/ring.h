// File: src/engine/ring.h
//
// A FIFO queue that keeps its room: a circular buffer that doubles when
// full and never shrinks. A connection's queues of writes and of received
// chunks go from empty to a few entries and back with every message; a
// std::deque there allocates a block and frees it again every few
// messages, this allocates nothing once it has seen its deepest moment.
#ifndef GRPC_RDMA_SRC_ENGINE_RING_H_
#define GRPC_RDMA_SRC_ENGINE_RING_H_

#include <cassert>
#include <cstddef>
#include <utility>
#include <vector>

namespace grpc_rdma {

// T must be default-constructible and move-assignable: a free slot holds
// a default T (what pop_front leaves, so an entry's resources go with it).
template <typename T>
class RingQueue {
 public:
  RingQueue() = default;
  RingQueue(RingQueue&& o) noexcept
      : slots_(std::move(o.slots_)), head_(o.head_), size_(o.size_) {
    o.slots_.clear();
    o.head_ = o.size_ = 0;
  }
  RingQueue& operator=(RingQueue&& o) noexcept {
    if (this != &o) {
      slots_ = std::move(o.slots_);
      head_ = o.head_;
      size_ = o.size_;
      o.slots_.clear();
      o.head_ = o.size_ = 0;
    }
    return *this;
  }
  RingQueue(const RingQueue&) = delete;
  RingQueue& operator=(const RingQueue&) = delete;

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return slots_[head_]; }
  const T& front() const { return slots_[head_]; }
  T& back() { return slots_[Index(size_ - 1)]; }
  T& operator[](size_t i) { return slots_[Index(i)]; }
  const T& operator[](size_t i) const { return slots_[Index(i)]; }

  void push_back(T v) {
    if (size_ == slots_.size()) Grow();
    slots_[Index(size_)] = std::move(v);
    ++size_;
  }
  void pop_front() {
    assert(!empty());
    slots_[head_] = T();
    head_ = (head_ + 1) & (slots_.size() - 1);
    --size_;
  }
  void clear() {
    while (!empty()) pop_front();
  }

  template <typename Q, typename V>
  class Iter {
   public:
    Iter(Q* q, size_t i) : q_(q), i_(i) {}
    V& operator*() const { return (*q_)[i_]; }
    V* operator->() const { return &(*q_)[i_]; }
    Iter& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const Iter& o) const { return i_ != o.i_; }
    bool operator==(const Iter& o) const { return i_ == o.i_; }

   private:
    Q* q_;
    size_t i_;
  };
  using iterator = Iter<RingQueue, T>;
  using const_iterator = Iter<const RingQueue, const T>;
  iterator begin() { return iterator(this, 0); }
  iterator end() { return iterator(this, size_); }
  const_iterator begin() const { return const_iterator(this, 0); }
  const_iterator end() const { return const_iterator(this, size_); }

 private:
  size_t Index(size_t i) const { return (head_ + i) & (slots_.size() - 1); }
  void Grow() {
    std::vector<T> bigger(slots_.empty() ? 4 : slots_.size() * 2);
    for (size_t i = 0; i < size_; ++i) bigger[i] = std::move(slots_[Index(i)]);
    slots_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;  // a power of two long (or empty)
  size_t head_ = 0;
  size_t size_ = 0;
};

}  // namespace grpc_rdma

#endif  // GRPC_RDMA_SRC_ENGINE_RING_H_
