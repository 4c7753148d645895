// The listener under the routes: cpp-httplib's server with a deep listen backlog and a HeaderGate in front of
// its worker pool. A new connection waits for its request headers in the gate (one thread for all of them),
// never in a worker, so slow or silent clients cannot hold the workers real requests need; once the headers
// are there, a worker serves the connection (keep-alive included) through httplib's own request processing.
// The routes themselves are added by http_server.cpp.
#pragma once
#include <httplib.h>

#include <memory>
#include <mutex>

#include "server/header_gate.h"

namespace kiln::server {

struct ServerOptions;

class ListeningServer : public httplib::Server {
 public:
  ListeningServer() = default;
  ~ListeningServer() override;

  // Raises the listen backlog of the bound socket (httplib's is 5: a burst of clients would see resets).
  void raise_backlog(int backlog);
  // Timeouts, the header gate and the worker pool (a fixed pool: an open SSE stream holds one worker).
  void configure(const ServerOptions& o);
  void stop_gate();

 private:
  class Pool;
  void dispatch(int fd);
  bool process_and_close_socket(socket_t sock) override;
  bool serve(socket_t sock);
  bool next_request(socket_t sock) const;

  int read_timeout_s_ = 30, write_timeout_s_ = 60, keep_alive_timeout_s_ = 5;
  std::unique_ptr<HeaderGate> gate_;
  std::mutex pool_mu_;
  httplib::ThreadPool* pool_ = nullptr;
};

}  // namespace kiln::server
