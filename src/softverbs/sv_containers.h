// softverbs: containers for the work of every message. An HCA allocates
// nothing per work request; these let the device's steady state allocate
// nothing either (a std::vector per post, frame and receive, and a
// std::deque block every few entries, were most of a small message's
// allocations).
//
//   SmallVec<T, N>  a vector of trivially copyable elements whose first N
//                   live inside it (scatter/gather lists: one or two
//                   entries as a rule);
//   Ring<T>         a FIFO queue in one array that doubles when full and
//                   never shrinks (work queues, completion queues, a
//                   wire's frames).
#ifndef SOFTVERBS_SV_CONTAINERS_H_
#define SOFTVERBS_SV_CONTAINERS_H_

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace softverbs {

template <typename T, size_t N>
class SmallVec {
  static_assert(std::is_trivially_copyable<T>::value, "elements are copied as bytes");

 public:
  SmallVec() = default;
  SmallVec(const SmallVec& o) { assign(o.begin(), o.end()); }
  SmallVec(SmallVec&& o) noexcept { Take(o); }
  SmallVec& operator=(const SmallVec& o) {
    if (this != &o) assign(o.begin(), o.end());
    return *this;
  }
  SmallVec& operator=(SmallVec&& o) noexcept {
    if (this != &o) {
      Free();
      Take(o);
    }
    return *this;
  }
  ~SmallVec() { Free(); }

  void assign(const T* first, const T* last) {
    size_t n = static_cast<size_t>(last - first);
    size_ = 0;
    Reserve(n);
    if (n > 0) memcpy(data(), first, n * sizeof(T));
    size_ = n;
  }
  void assign(size_t n, const T& v) {
    size_ = 0;
    Reserve(n);
    for (size_t i = 0; i < n; ++i) data()[i] = v;
    size_ = n;
  }
  void push_back(const T& v) {
    if (size_ == cap_) Reserve(cap_ * 2);
    data()[size_++] = v;
  }
  void append(const T* p, size_t n) {
    if (size_ + n > cap_) Reserve(size_ + n > cap_ * 2 ? size_ + n : cap_ * 2);
    if (n > 0) memcpy(data() + size_, p, n * sizeof(T));
    size_ += n;
  }
  void clear() { size_ = 0; }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T* data() { return heap_ != nullptr ? heap_ : reinterpret_cast<T*>(local_); }
  const T* data() const { return heap_ != nullptr ? heap_ : reinterpret_cast<const T*>(local_); }
  T* begin() { return data(); }
  T* end() { return data() + size_; }
  const T* begin() const { return data(); }
  const T* end() const { return data() + size_; }
  T& operator[](size_t i) { return data()[i]; }
  const T& operator[](size_t i) const { return data()[i]; }

 private:
  // Room for at least n, the elements kept.
  void Reserve(size_t n) {
    if (n <= cap_) return;
    T* p = static_cast<T*>(malloc(n * sizeof(T)));
    if (p == nullptr) throw std::bad_alloc();
    if (size_ > 0) memcpy(p, data(), size_ * sizeof(T));
    free(heap_);
    heap_ = p;
    cap_ = n;
  }
  void Free() {
    free(heap_);
    heap_ = nullptr;
    cap_ = N;
    size_ = 0;
  }
  // Takes o's elements (its heap block, or a copy of its local ones); o is
  // left empty.
  void Take(SmallVec& o) {
    if (o.heap_ != nullptr) {
      heap_ = o.heap_;
      cap_ = o.cap_;
      o.heap_ = nullptr;
      o.cap_ = N;
    } else if (o.size_ > 0) {
      memcpy(local_, o.local_, o.size_ * sizeof(T));
    }
    size_ = o.size_;
    o.size_ = 0;
  }

  alignas(T) unsigned char local_[N * sizeof(T)];
  T* heap_ = nullptr;
  size_t size_ = 0;
  size_t cap_ = N;
};

// Bytes a work request or frame carries itself (inline data): up to
// softverbs' default inline limit without the heap.
using Bytes = SmallVec<char, 256>;

// Elements move when the ring grows: hold no reference to one across a
// push. A popped slot is reset to T() at once (what it owned goes then).
template <typename T>
class Ring {
 public:
  class iterator {
   public:
    iterator(Ring* r, size_t i) : r_(r), i_(i) {}
    T& operator*() const { return (*r_)[i_]; }
    T* operator->() const { return &(*r_)[i_]; }
    iterator& operator++() {
      ++i_;
      return *this;
    }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }
    bool operator==(const iterator& o) const { return i_ == o.i_; }

   private:
    Ring* r_;
    size_t i_;
  };

  bool empty() const { return n_ == 0; }
  size_t size() const { return n_; }
  T& front() { return buf_[head_]; }
  const T& front() const { return buf_[head_]; }
  T& operator[](size_t i) { return buf_[Slot(i)]; }
  const T& operator[](size_t i) const { return buf_[Slot(i)]; }
  iterator begin() { return iterator(this, 0); }
  iterator end() { return iterator(this, n_); }

  void push_back(T v) {
    Grow();
    buf_[Slot(n_)] = std::move(v);
    ++n_;
  }
  void push_front(T v) {
    Grow();
    head_ = (head_ + buf_.size() - 1) & (buf_.size() - 1);
    buf_[head_] = std::move(v);
    ++n_;
  }
  void pop_front() {
    buf_[head_] = T();
    head_ = (head_ + 1) & (buf_.size() - 1);
    --n_;
  }
  void clear() {
    while (n_ > 0) pop_front();
    head_ = 0;
  }
  void swap(Ring& o) {
    buf_.swap(o.buf_);
    std::swap(head_, o.head_);
    std::swap(n_, o.n_);
  }
  // Drops the elements `pred` holds for, keeping the others in order.
  template <typename Pred>
  void RemoveIf(Pred pred) {
    size_t kept = 0;
    for (size_t i = 0; i < n_; ++i) {
      if (pred(static_cast<const T&>(buf_[Slot(i)]))) continue;
      if (kept != i) buf_[Slot(kept)] = std::move(buf_[Slot(i)]);
      ++kept;
    }
    for (size_t i = kept; i < n_; ++i) buf_[Slot(i)] = T();
    n_ = kept;
  }

 private:
  size_t Slot(size_t i) const { return (head_ + i) & (buf_.size() - 1); }
  void Grow() {
    if (n_ < buf_.size()) return;
    std::vector<T> bigger(buf_.empty() ? 8 : buf_.size() * 2);  // a power of two
    for (size_t i = 0; i < n_; ++i) bigger[i] = std::move(buf_[Slot(i)]);
    buf_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> buf_;
  size_t head_ = 0;
  size_t n_ = 0;
};

}  // namespace softverbs

#endif  // SOFTVERBS_SV_CONTAINERS_H_
