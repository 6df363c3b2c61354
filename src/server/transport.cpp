// One reactor thread (poll over the listening socket and every connection not being answered)
// and a fixed pool of workers. A connection belongs to exactly one of them at a time: the reactor
// reads and frames a request, a worker answers it and gives the connection back; only the reactor
// closes descriptors, so a number is never reused while someone still holds it.
#include "server/transport.h"

#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace moestream {

namespace {

using clock_type = std::chrono::steady_clock;

clock_type::time_point after(clock_type::time_point t, double seconds) {
  return t +
         std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(seconds));
}

std::string lower_trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

constexpr size_t kMaxChunkLine = 4096;   // a chunk-size line or a trailer
constexpr size_t kMaxLinger = 4u << 20;  // bytes read and dropped after a refusal
constexpr double kLingerSeconds = 1;

struct Rejection {
  int status;
  std::string reason;   // for /metrics
  std::string message;  // for the client
};

struct Conn {
  int fd = -1;
  std::string ip;
  int port = 0;
  enum State { Idle, Head, Body, Busy, Lingering } state = Head;
  clock_type::time_point deadline;
  std::string buf;  // read, not yet handed out (may hold the start of a pipelined request)
  int served = 0;
  size_t lingered = 0;
  // The body's framing, once the head is complete.
  size_t head_len = 0;
  bool chunked = false;
  uint64_t content_length = 0;
  enum Phase { Size, Data, Trailers } phase = Size;
  size_t scan = 0;  // chunked: where the next unparsed piece starts in buf
  uint64_t chunk_left = 0;
  uint64_t body_bytes = 0;  // chunked: decoded so far
};

const char* status_text(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

}  // namespace

bool write_all(int fd, const char* data, size_t size, double timeout_s) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data += n;
      size -= size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
    pollfd p{fd, POLLOUT, 0};
    const int r = ::poll(&p, 1, int(timeout_s * 1000));
    if (r <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL))) return false;
  }
  return true;
}

struct Transport::Impl {
  TransportOptions o;
  RequestHandler handler;
  int listen_fd = -1;
  int wake_fd = -1;
  std::atomic<bool> stopping{false};

  // Reactor-owned.
  clock_type::time_point accept_paused_until;
  std::unordered_map<int, Conn> conns;
  std::unordered_map<std::string, int> per_client;

  // Workers.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Exchange> tasks;
  std::vector<std::pair<int, bool>> returned;  // (fd, keep open) from the workers
  std::vector<std::thread> workers;
  bool workers_stop = false;

  mutable std::mutex stats_mu;
  TransportStats stats;

  void wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd, &one, sizeof one);
  }

  void worker_loop() {
    for (;;) {
      Exchange x;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return workers_stop || !tasks.empty(); });
        if (workers_stop) return;
        x = std::move(tasks.front());
        tasks.pop_front();
      }
      bool keep = false;
      try {
        keep = handler(x);
      } catch (const std::exception&) {
        keep = false;
      }
      {
        std::lock_guard lock(mu);
        returned.emplace_back(x.fd, keep && !x.close);
      }
      wake();
    }
  }

  void close_conn(int fd) {
    auto it = conns.find(fd);
    if (it == conns.end()) return;
    if (--per_client[it->second.ip] <= 0) per_client.erase(it->second.ip);
    ::close(fd);
    conns.erase(it);
    std::lock_guard lock(stats_mu);
    stats.open = int64_t(conns.size());
  }

  void count_rejection(const std::string& reason) {
    std::lock_guard lock(stats_mu);
    ++stats.rejected[reason];
  }

  // Answers with a JSON error and stops reading: the rest of what the client sends is dropped
  // for a moment (so it sees the answer, not a reset), then the connection is closed.
  void reject(Conn& c, const Rejection& r) {
    const std::string body = nlohmann::json{
        {"error",
         {{"message", r.message},
          {"type", "invalid_request_error"},
          {"param", nullptr},
          {"code", r.status}}}}.dump();
    const std::string head =
        "HTTP/1.1 " + std::to_string(r.status) + " " + status_text(r.status) +
        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\nConnection: close\r\n\r\n";
    const std::string msg = head + body;
    [[maybe_unused]] ssize_t n = ::send(c.fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    ::shutdown(c.fd, SHUT_WR);
    c.state = Conn::Lingering;
    c.buf.clear();
    c.buf.shrink_to_fit();
    c.deadline = after(clock_type::now(), kLingerSeconds);
    count_rejection(r.reason);
  }

  // Reads the head's framing headers. Returns a rejection, or nothing when the body can be read.
  std::optional<Rejection> parse_head(Conn& c, bool& expect_continue) {
    bool has_length = false;
    size_t pos = c.buf.find("\r\n") + 2;  // past the request line
    while (pos < c.head_len - 2) {
      const size_t eol = c.buf.find("\r\n", pos);
      const std::string_view line(c.buf.data() + pos, eol - pos);
      const size_t colon = line.find(':');
      if (colon != std::string_view::npos) {
        const std::string name = lower_trimmed(line.substr(0, colon));
        const std::string value = lower_trimmed(line.substr(colon + 1));
        if (name == "content-length") {
          const bool digits = !value.empty() && value.size() <= 19 &&
                              std::all_of(value.begin(), value.end(),
                                          [](char ch) { return ch >= '0' && ch <= '9'; });
          if (!digits)
            return Rejection{400, "bad_content_length", "invalid Content-Length '" + value + "'"};
          const uint64_t n = std::stoull(value);
          if (has_length && n != c.content_length)
            return Rejection{400, "bad_content_length", "conflicting Content-Length headers"};
          has_length = true;
          c.content_length = n;
        } else if (name == "transfer-encoding") {
          if (value != "chunked")
            return Rejection{501, "bad_transfer_encoding",
                             "unsupported Transfer-Encoding '" + value + "'"};
          c.chunked = true;
        } else if (name == "expect" && value == "100-continue") {
          // Answered here, before the body is read; the header is renamed so that the handler
          // does not answer it a second time.
          c.buf[pos] = 'X';
          expect_continue = true;
        }
      }
      pos = eol + 2;
    }
    if (c.chunked && has_length)
      return Rejection{400, "bad_content_length",
                       "both Content-Length and Transfer-Encoding were sent"};
    if (has_length && c.content_length > o.max_body_bytes)
      return Rejection{413, "body_too_large",
                       "the request body is " + std::to_string(c.content_length) +
                           " bytes; at most " + std::to_string(o.max_body_bytes) + " are accepted"};
    return std::nullopt;
  }

  // Advances the chunked parser. Returns the end of the request in buf (0: not complete yet), or
  // sets `rejection`.
  size_t scan_chunks(Conn& c, std::optional<Rejection>& rejection) {
    for (;;) {
      if (c.phase == Conn::Data) {
        if (c.buf.size() < c.scan + c.chunk_left + 2) return 0;
        if (c.buf.compare(c.scan + c.chunk_left, 2, "\r\n") != 0) {
          rejection = Rejection{400, "bad_chunk",
                                "malformed chunked body (a chunk does not end with CRLF)"};
          return 0;
        }
        c.scan += c.chunk_left + 2;
        c.phase = Conn::Size;
        continue;
      }
      const size_t eol = c.buf.find("\r\n", c.scan);
      if (eol == std::string::npos) {
        if (c.buf.size() - c.scan > kMaxChunkLine)
          rejection = Rejection{400, "bad_chunk", "malformed chunked body (a line is too long)"};
        return 0;
      }
      if (eol - c.scan > kMaxChunkLine) {
        rejection = Rejection{400, "bad_chunk", "malformed chunked body (a line is too long)"};
        return 0;
      }
      const std::string line = c.buf.substr(c.scan, eol - c.scan);
      c.scan = eol + 2;
      if (c.phase == Conn::Trailers) {
        if (line.empty()) return c.scan;
        continue;
      }
      const std::string size = lower_trimmed(line.substr(0, line.find(';')));
      if (size.empty() || size.size() > 15 ||
          size.find_first_not_of("0123456789abcdef") != std::string::npos) {
        rejection =
            Rejection{400, "bad_chunk", "malformed chunked body (bad chunk size '" + size + "')"};
        return 0;
      }
      const uint64_t n = std::stoull(size, nullptr, 16);
      if (n == 0) {
        c.phase = Conn::Trailers;
        continue;
      }
      c.body_bytes += n;
      if (c.body_bytes > o.max_body_bytes) {
        rejection = Rejection{
            413, "body_too_large",
            "the chunked request body exceeds " + std::to_string(o.max_body_bytes) + " bytes"};
        return 0;
      }
      c.chunk_left = n;
      c.phase = Conn::Data;
    }
  }

  // Frames what the connection has read: rejects it, dispatches a complete request, or waits.
  void frame(Conn& c, clock_type::time_point now) {
    if (c.state == Conn::Idle && !c.buf.empty()) {
      c.state = Conn::Head;
      c.deadline = after(now, o.header_timeout_s);
    }
    if (c.state == Conn::Head) {
      const size_t end = c.buf.find("\r\n\r\n");
      if (end == std::string::npos || end + 4 > o.max_header_bytes) {
        if (c.buf.size() > o.max_header_bytes || end != std::string::npos)
          reject(c, {431, "header_too_large",
                     "the request head exceeds " + std::to_string(o.max_header_bytes) + " bytes"});
        return;
      }
      c.head_len = end + 4;
      c.chunked = false;
      c.content_length = 0;
      c.phase = Conn::Size;
      c.scan = c.head_len;
      c.body_bytes = 0;
      bool expect_continue = false;
      if (auto r = parse_head(c, expect_continue)) return reject(c, *r);
      c.state = Conn::Body;
      c.deadline = after(now, o.body_timeout_s);
      const bool have_body = c.chunked ? false : c.buf.size() >= c.head_len + c.content_length;
      if (expect_continue && !have_body) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        [[maybe_unused]] ssize_t n =
            ::send(c.fd, cont, sizeof cont - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    if (c.state != Conn::Body) return;
    size_t end = 0;
    if (c.chunked) {
      std::optional<Rejection> r;
      end = scan_chunks(c, r);
      if (r) return reject(c, *r);
    } else if (c.buf.size() >= c.head_len + c.content_length) {
      end = c.head_len + size_t(c.content_length);
    }
    if (end == 0) return;
    Exchange x{c.fd, c.buf.substr(0, end), c.ip, c.port, ++c.served >= o.keep_alive_max};
    c.buf.erase(0, end);
    c.state = Conn::Busy;
    {
      std::lock_guard lock(mu);
      tasks.push_back(std::move(x));
    }
    cv.notify_one();
  }

  void accept_all(clock_type::time_point now) {
    for (int i = 0; i < 64; ++i) {
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len,
                               SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        // Out of descriptors: the listening socket stays readable, so pause accepting briefly
        // rather than spin; the backlog holds the clients meanwhile.
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
          accept_paused_until = after(now, 0.1);
        return;
      }
      char host[NI_MAXHOST] = "", serv[NI_MAXSERV] = "";
      ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      Conn& c = conns[fd];
      c.fd = fd;
      c.ip = host;
      c.port = std::atoi(serv);
      c.state = Conn::Head;  // a new connection must start its request within the head deadline
      c.deadline = after(now, o.header_timeout_s);
      const int from_client = ++per_client[c.ip];
      {
        std::lock_guard lock(stats_mu);
        ++stats.accepted;
        stats.open = int64_t(conns.size());
      }
      if (int(conns.size()) > o.max_connections)
        reject(c, {503, "too_many_connections",
                   "the server has too many open connections; retry later"});
      else if (from_client > o.max_connections_per_client)
        reject(c, {503, "too_many_client_connections",
                   "too many open connections from " + c.ip + " (at most " +
                       std::to_string(o.max_connections_per_client) + ")"});
    }
  }

  // Reads what arrived. Returns false when the connection is finished.
  bool read_conn(Conn& c, clock_type::time_point now) {
    char chunk[65536];
    for (int i = 0; i < 16; ++i) {
      const ssize_t n = ::recv(c.fd, chunk, sizeof chunk, 0);
      if (n == 0) return false;
      if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
      if (c.state == Conn::Lingering) {
        c.lingered += size_t(n);
        if (c.lingered > kMaxLinger) return false;
        continue;
      }
      c.buf.append(chunk, size_t(n));
      frame(c, now);
      if (c.state == Conn::Busy) return true;  // the rest waits until the answer is written
    }
    return true;
  }

  void take_returned(clock_type::time_point now) {
    std::vector<std::pair<int, bool>> back;
    {
      std::lock_guard lock(mu);
      back.swap(returned);
    }
    for (auto [fd, keep] : back) {
      auto it = conns.find(fd);
      if (it == conns.end()) continue;
      if (!keep || stopping) {
        close_conn(fd);
        continue;
      }
      Conn& c = it->second;
      c.state = Conn::Idle;
      c.deadline = after(now, o.idle_timeout_s);
      frame(c, now);  // a pipelined request may be waiting in the buffer
    }
  }

  void expire(clock_type::time_point now) {
    std::vector<int> closing;
    for (auto& [fd, c] : conns) {
      if (c.state == Conn::Busy || now < c.deadline) continue;
      if (c.state == Conn::Idle || c.state == Conn::Lingering ||
          (c.state == Conn::Head && c.buf.empty())) {
        closing.push_back(fd);
      } else if (c.state == Conn::Head) {
        reject(c, {408, "header_timeout",
                   "the request head was not complete within " +
                       nlohmann::json(o.header_timeout_s).dump() + " s"});
      } else {
        reject(c, {408, "body_timeout",
                   "the request body was not complete within " +
                       nlohmann::json(o.body_timeout_s).dump() + " s"});
      }
    }
    for (int fd : closing) close_conn(fd);
  }

  // glibc keeps what the workers' requests freed in its arenas (one per thread that allocates, up
  // to 8 per core) for later allocations: the soak's RSS rose ~1 MB in its second minute and
  // ~0.1 MB in its fourth, and malloc_trim(0) gave back 7 MB of it (docs/RELIABILITY.md, "Soak").
  // Once no request is being answered, at most every 10 s, it is given back to the system.
  void trim_when_idle(clock_type::time_point now, bool busy) {
    if (busy) {
      used_since_trim = true;
      return;
    }
    if (!used_since_trim || now < next_trim) return;
#ifdef __GLIBC__
    ::malloc_trim(0);
#endif
    used_since_trim = false;
    next_trim = after(now, 10.0);
    std::lock_guard lock(stats_mu);
    ++stats.memory_trims;
  }
  bool used_since_trim = false;
  clock_type::time_point next_trim;

  void reactor() {
    std::vector<pollfd> fds;
    std::vector<int> finished;
    while (!stopping) {
      auto now = clock_type::now();
      take_returned(now);
      fds.clear();
      fds.push_back({wake_fd, POLLIN, 0});
      fds.push_back(
          {now < accept_paused_until ? -1 : listen_fd, POLLIN, 0});  // -1: skipped by poll
      auto next = after(now, 1.0);
      for (auto& [fd, c] : conns) {
        if (c.state == Conn::Busy) continue;
        fds.push_back({fd, POLLIN, 0});
        next = std::min(next, c.deadline);
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count();
      if (::poll(fds.data(), fds.size(), int(std::clamp<int64_t>(wait + 1, 0, 1000))) < 0 &&
          errno != EINTR)
        break;
      now = clock_type::now();
      if (fds[0].revents) {
        uint64_t v;
        [[maybe_unused]] ssize_t n = ::read(wake_fd, &v, sizeof v);
      }
      finished.clear();
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        auto it = conns.find(fds[i].fd);
        if (it == conns.end() || it->second.state == Conn::Busy) continue;
        if (!read_conn(it->second, now) && it->second.state != Conn::Busy)
          finished.push_back(fds[i].fd);
      }
      for (int fd : finished) close_conn(fd);
      if (fds[1].revents) accept_all(now);
      expire(now);
      trim_when_idle(now, std::any_of(conns.begin(), conns.end(),
                                      [](const auto& fc) { return fc.second.state == Conn::Busy; }));
    }
  }
};

Transport::Transport(const TransportOptions& options, RequestHandler handler)
    : impl_(std::make_unique<Impl>()) {
  impl_->o = options;
  impl_->handler = std::move(handler);
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) fail("serve: cannot create an eventfd: ", std::strerror(errno));
}

Transport::~Transport() {
  stop();
  if (impl_->listen_fd >= 0) ::close(impl_->listen_fd);
  for (auto& [fd, c] : impl_->conns) ::close(fd);
  ::close(impl_->wake_fd);
}

int Transport::bind(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* list = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &list) != 0 || !list)
    fail("serve: cannot resolve the address '", host, "'");
  int fd = -1;
  for (addrinfo* a = list; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(list);
  if (fd < 0)
    fail("serve: cannot listen on ", host, ":", port, " (address in use or not available)");
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  impl_->listen_fd = fd;
  return addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

int Transport::listen_fd() const {
  return impl_->listen_fd;
}

void Transport::run() {
  Impl& m = *impl_;
  if (m.listen_fd < 0) fail("serve: run() before bind()");
  for (int i = 0; i < std::max(1, m.o.workers); ++i)
    m.workers.emplace_back([&m] { m.worker_loop(); });
  m.reactor();
  {
    std::lock_guard lock(m.mu);
    m.workers_stop = true;
  }
  m.cv.notify_all();
  for (auto& t : m.workers) t.join();
  m.workers.clear();
  for (auto& [fd, c] : m.conns) ::close(fd);
  m.conns.clear();
  m.per_client.clear();
  ::close(m.listen_fd);
  m.listen_fd = -1;
  std::lock_guard lock(m.stats_mu);
  m.stats.open = 0;
}

void Transport::stop() {
  impl_->stopping = true;
  impl_->wake();
}

TransportStats Transport::stats() const {
  std::lock_guard lock(impl_->stats_mu);
  return impl_->stats;
}

}  // namespace moestream
