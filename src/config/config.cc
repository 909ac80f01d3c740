#include "config/config.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <limits>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace grpc_rdma {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024, kTiB = kGiB * 1024;

// The allowed ranges; the defaults are in Options (grpc_rdma/options.h).
constexpr uint64_t kMinChunk = 4 * kKiB, kMaxChunk = kGiB;
constexpr uint64_t kMinAcc = 64, kMaxAcc = kMiB;
constexpr uint64_t kMaxBuf = kTiB;

bool ParseSize(const std::string& text, uint64_t* out) {
  std::string s(absl::StripAsciiWhitespace(text));
  size_t i = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) ++i;
  if (i == 0 || i > 19) return false;
  uint64_t value = std::strtoull(s.substr(0, i).c_str(), nullptr, 10);
  // "4 MiB", as FormatBytes prints sizes (and the messages suggest them),
  // as well as "4MiB" and "4M".
  std::string unit = absl::AsciiStrToLower(absl::StripLeadingAsciiWhitespace(s.substr(i)));
  uint64_t mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb" || unit == "kib") mult = kKiB;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = kMiB;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = kGiB;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = kTiB;
  else return false;
  if (value > std::numeric_limits<uint64_t>::max() / mult) return false;
  *out = value * mult;
  return true;
}

bool ParseInt(const std::string& text, int64_t* out) {
  std::string s(absl::StripAsciiWhitespace(text));
  if (s.empty() || s.size() > 18) return false;
  size_t i = (s[0] == '-') ? 1 : 0;
  if (i == s.size()) return false;
  for (size_t k = i; k < s.size(); ++k)
    if (!isdigit(static_cast<unsigned char>(s[k]))) return false;
  *out = std::strtoll(s.c_str(), nullptr, 10);
  return true;
}

bool ParseBool(const std::string& text, bool* out) {
  std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  if (s == "1" || s == "true" || s == "yes" || s == "on") {
    *out = true;
    return true;
  }
  if (s == "0" || s == "false" || s == "no" || s == "off") {
    *out = false;
    return true;
  }
  return false;
}

// Collects every problem so the user fixes them all in one go.
class Parser {
 public:
  explicit Parser(const EnvLookup& lookup) : lookup_(lookup) {}

  void Bool(const char* name, bool* field) {
    auto v = lookup_(name);
    if (!v) return;
    if (!ParseBool(*v, field))
      Bad(name, *v, "expected true or false (also 1/0, yes/no, on/off)");
  }

  void Size(const char* name, uint64_t min, uint64_t max, uint64_t* field) {
    auto v = lookup_(name);
    if (!v) return;
    uint64_t x = 0;
    std::string allowed = absl::StrCat("expected a size in bytes from ", FormatBytes(min), " to ",
                                       FormatBytes(max),
                                       ", as a whole number optionally followed by K, M or G "
                                       "(powers of 1024), e.g. ",
                                       *field, " or ", FormatBytes(*field));
    if (!ParseSize(*v, &x) || x < min || x > max) {
      Bad(name, *v, allowed);
      return;
    }
    *field = x;
  }

  void Int(const char* name, int64_t min, int64_t max, int* field, const char* unit) {
    auto v = lookup_(name);
    if (!v) return;
    int64_t x = 0;
    if (!ParseInt(*v, &x) || x < min || x > max) {
      Bad(name, *v,
          absl::StrCat("expected a whole number", *unit != '\0' ? absl::StrCat(" of ", unit) : "",
                       " from ", min, " to ", max));
      return;
    }
    *field = static_cast<int>(x);
  }

  template <typename E>
  void Enum(const char* name, const std::vector<std::pair<const char*, E>>& values, E* field) {
    auto v = lookup_(name);
    if (!v) return;
    std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(*v));
    std::vector<std::string> names;
    for (const auto& [n, e] : values) {
      if (s == n) {
        *field = e;
        return;
      }
      names.push_back(n);
    }
    Bad(name, *v, absl::StrCat("expected one of ", absl::StrJoin(names, ", ")));
  }

  void Device(const char* name, Options* o) {
    auto v = lookup_(name);
    if (!v) return;
    std::string s(absl::StripAsciiWhitespace(*v));
    bool ok = !s.empty() && s.size() < 64;
    for (char c : s) ok &= isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
    if (!ok) {
      Bad(name, *v, "expected an RDMA device name such as mlx5_0 (as ibv_devices lists them)");
      return;
    }
    o->device = s;
    o->device_explicit = true;
  }

  void Destination(const char* name, std::string* field) {
    auto v = lookup_(name);
    if (!v) return;
    std::string s(absl::StripAsciiWhitespace(*v));
    if (s.find('\0') != std::string::npos || s.size() > 4096) {
      Bad(name, *v, "expected stderr or a file path");
      return;
    }
    *field = s;
  }

  void Add(std::string problem) { problems_.push_back(std::move(problem)); }

  absl::Status Result() const {
    if (problems_.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrJoin(problems_, "; "));
  }

 private:
  void Bad(const char* name, const std::string& value, const std::string& allowed) {
    problems_.push_back(absl::StrCat(name, "='", value, "' is not valid: ", allowed));
  }

  const EnvLookup& lookup_;
  std::vector<std::string> problems_;
};

// The relations between fields, checked on what the engine runs with
// (`e`, acc_size with the framing room); `framing` is that room (0 when
// the options came to the engine as they are), so that the messages name
// what the user set.
void Relations(const Options& e, uint64_t framing, Parser* p) {
  const uint64_t user_acc = e.acc_size - std::min(framing, e.acc_size);
  const std::string acc_words =
      framing == 0 ? absl::StrCat("TF_RDMA_ACC_SIZE ", FormatBytes(e.acc_size))
                   : absl::StrCat("(TF_RDMA_ACC_SIZE ", FormatBytes(user_acc), " + ",
                                  FormatBytes(framing), " of framing room)");
  if (user_acc > e.chunk_size) {
    p->Add(absl::StrCat("TF_RDMA_ACC_SIZE (", FormatBytes(user_acc),
                        ") is larger than TF_RDMA_CHUNK_SIZE (", FormatBytes(e.chunk_size),
                        "): small payloads are coalesced up to ACC_SIZE and large ones cut into "
                        "CHUNK_SIZE pieces, so ACC_SIZE must not exceed CHUNK_SIZE"));
  }
  uint64_t need = OneConnectionBytes(e);
  if (e.buf_size < need) {
    p->Add(absl::StrCat("TF_RDMA_BUF_SIZE (", FormatBytes(e.buf_size),
                        ") is too small: one connection needs ", FormatBytes(need), " (",
                        e.chunks_in_flight, " chunks in flight x TF_RDMA_CHUNK_SIZE ",
                        FormatBytes(e.chunk_size), " + 2 x ", e.eager_depth,
                        " eager buffers x ", acc_words, "); raise it or lower the others"));
  }
}

// The ranges of the fields (each field is also a variable, parsed with the
// same bounds); `max_acc` is the engine's or the user's.
void Ranges(const Options& o, uint64_t max_acc, Parser* p) {
  auto range = [&](const char* what, uint64_t v, uint64_t lo, uint64_t hi) {
    if (v < lo || v > hi)
      p->Add(absl::StrCat(what, " is ", v, ": allowed from ", lo, " to ", hi));
  };
  range("chunk_size", o.chunk_size, kMinChunk, kMaxChunk);
  range("acc_size", o.acc_size, kMinAcc, max_acc);
  range("buf_size", o.buf_size, 1, kMaxBuf);
  range("chunks_in_flight", static_cast<uint64_t>(o.chunks_in_flight), 1, 64);
  range("eager_depth", static_cast<uint64_t>(o.eager_depth), 3, 4096);
  range("spin_us", static_cast<uint64_t>(o.spin_us), 0, 1000000);
  range("connect_timeout_ms", static_cast<uint64_t>(o.connect_timeout_ms), 1, 600000);
  range("max_half_open", static_cast<uint64_t>(o.max_half_open), 1, 100000);
  range("grant_timeout_ms", static_cast<uint64_t>(o.grant_timeout_ms), 100, 3600000);
  range("fallback_ttl_s", static_cast<uint64_t>(o.fallback_ttl_s), 0, 86400);
  range("stats_interval_s", static_cast<uint64_t>(o.stats_interval_s), 0, 86400);
  // Unset: 0 for the port, -1 for the others.
  auto settable = [&](const char* what, int v, int unset, int lo, int hi) {
    if (v != unset && (v < lo || v > hi))
      p->Add(absl::StrCat(what, " is ", v, ": allowed ", unset, " (unset) or ", lo, " to ", hi));
  };
  settable("port", o.port, 0, 1, 255);
  settable("gid_index", o.gid_index, -1, 0, 65535);
  settable("tos", o.tos, -1, 0, 255);
}

Options WithFraming(const Options& o, uint64_t* framing) {
  Options e = o;
  e.acc_size = std::min(o.acc_size + kFramingRoom, std::max(o.chunk_size, o.acc_size));
  *framing = e.acc_size - o.acc_size;
  return e;
}

}  // namespace

uint64_t OneConnectionBytes(const Options& e) {
  return static_cast<uint64_t>(e.chunks_in_flight) * e.chunk_size +
         2ull * static_cast<uint64_t>(e.eager_depth) * e.acc_size;
}

EnvLookup ProcessEnvironment() {
  return [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr) return std::nullopt;
    return std::string(v);
  };
}

absl::StatusOr<Options> ParseOptions(const EnvLookup& lookup) {
  Options o;
  Parser p(lookup);
  p.Bool("TF_RDMA_ENABLED", &o.enabled);
  p.Device("TF_RDMA_DEV_NAME", &o);
  p.Int("TF_RDMA_PORT", 1, 255, &o.port, "");
  p.Int("TF_RDMA_GID_INDEX", 0, 65535, &o.gid_index, "");
  p.Int("TF_RDMA_TOS", 0, 255, &o.tos, "");
  p.Size("TF_RDMA_CHUNK_SIZE", kMinChunk, kMaxChunk, &o.chunk_size);
  p.Size("TF_RDMA_ACC_SIZE", kMinAcc, kMaxAcc, &o.acc_size);
  p.Size("TF_RDMA_BUF_SIZE", 1, kMaxBuf, &o.buf_size);
  p.Int("TF_RDMA_CHUNKS_IN_FLIGHT", 1, 64, &o.chunks_in_flight, "chunks");
  p.Int("TF_RDMA_EAGER_DEPTH", 3, 4096, &o.eager_depth, "buffers");
  p.Enum<PollMode>("TF_RDMA_POLL_MODE",
                   {{"adaptive", PollMode::kAdaptive},
                    {"busy", PollMode::kBusy},
                    {"event", PollMode::kEvent}},
                   &o.poll_mode);
  p.Int("TF_RDMA_SPIN_US", 0, 1000000, &o.spin_us, "microseconds");
  p.Int("TF_RDMA_CONNECT_TIMEOUT_MS", 1, 600000, &o.connect_timeout_ms, "milliseconds");
  p.Int("TF_RDMA_MAX_HALF_OPEN", 1, 100000, &o.max_half_open, "connections");
  p.Int("TF_RDMA_GRANT_TIMEOUT_MS", 100, 3600000, &o.grant_timeout_ms, "milliseconds");
  p.Enum<Fallback>("TF_RDMA_FALLBACK", {{"tcp", Fallback::kTcp}, {"none", Fallback::kNone}},
                   &o.fallback);
  p.Int("TF_RDMA_FALLBACK_TTL_S", 0, 86400, &o.fallback_ttl_s, "seconds");
  p.Destination("TF_RDMA_STATS", &o.stats_dump);
  p.Int("TF_RDMA_STATS_INTERVAL_S", 0, 86400, &o.stats_interval_s, "seconds");
  p.Bool("TF_RDMA_MALLOC_TUNE", &o.malloc_tune);
  p.Bool("TF_RDMA_ZERO_COPY", &o.zero_copy);
  p.Bool("TF_RDMA_TCP_FIRST", &o.tcp_first);
  absl::Status s = p.Result();
  if (!s.ok()) return s;  // relations between bad values would only add noise
  uint64_t framing = 0;
  const Options e = WithFraming(o, &framing);
  Relations(e, framing, &p);
  s = p.Result();
  if (!s.ok()) return s;
  return o;
}

absl::StatusOr<Options> OptionsFromEnvironment() { return ParseOptions(ProcessEnvironment()); }

absl::Status ValidateOptions(const Options& o) {
  Parser p([](const char*) { return std::optional<std::string>(); });
  Ranges(o, kMaxAcc, &p);
  absl::Status s = p.Result();
  if (!s.ok()) return s;
  uint64_t framing = 0;
  const Options e = WithFraming(o, &framing);
  Relations(e, framing, &p);
  return p.Result();
}

Options EngineOptions(const Options& o) {
  uint64_t framing = 0;
  return WithFraming(o, &framing);
}

absl::Status ValidateEngineOptions(const Options& e) {
  Parser p([](const char*) { return std::optional<std::string>(); });
  Ranges(e, kMaxEngineAccSize, &p);
  absl::Status s = p.Result();
  if (!s.ok()) return s;
  Relations(e, 0, &p);
  return p.Result();
}

std::string FormatBytes(uint64_t b) {
  struct Unit {
    uint64_t size;
    const char* name;
  };
  for (Unit u : {Unit{kTiB, "TiB"}, Unit{kGiB, "GiB"}, Unit{kMiB, "MiB"}, Unit{kKiB, "KiB"}}) {
    if (b >= u.size && b % u.size == 0) return absl::StrCat(b / u.size, " ", u.name);
  }
  return absl::StrCat(b, " B");
}

std::string DescribeOptions(const Options& o) {
  const char* poll = o.poll_mode == PollMode::kBusy    ? "busy"
                     : o.poll_mode == PollMode::kEvent ? "event"
                                                       : "adaptive";
  return absl::StrCat("enabled=", o.enabled ? "true" : "false", " device=", o.device,
                      o.device_explicit ? "" : " (default)", " chunk_size=",
                      FormatBytes(o.chunk_size), " acc_size=", FormatBytes(o.acc_size),
                      " buf_size=", FormatBytes(o.buf_size),
                      " chunks_in_flight=", o.chunks_in_flight, " eager_depth=", o.eager_depth,
                      " poll_mode=", poll, " spin_us=", o.spin_us,
                      " connect_timeout_ms=", o.connect_timeout_ms,
                      " max_half_open=", o.max_half_open,
                      " grant_timeout_ms=", o.grant_timeout_ms,
                      " fallback=", o.fallback == Fallback::kTcp ? "tcp" : "none",
                      " fallback_ttl_s=", o.fallback_ttl_s,
                      " malloc_tune=", o.malloc_tune ? "true" : "false",
                      " zero_copy=", o.zero_copy ? "true" : "false",
                      " tcp_first=", o.tcp_first ? "true" : "false",
                      o.port > 0 ? absl::StrCat(" port=", o.port) : "",
                      o.gid_index >= 0 ? absl::StrCat(" gid_index=", o.gid_index) : "",
                      o.tos >= 0 ? absl::StrCat(" tos=", o.tos) : "");
}

}  // namespace grpc_rdma
