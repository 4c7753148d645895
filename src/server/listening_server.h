// The listener under the routes: cpp-httplib's server with a deep listen backlog and a RequestGate in front of two
// worker pools. httplib's accept loop hands each new socket straight to the gate (no worker involved); the gate
// reads the connection's request, headers and body, on its one thread, and hands the connection to a worker only
// when the whole request is in memory. The worker runs httplib's request processing (routing, handlers, the
// answer, streamed or not) over that buffer, so it never waits for a slow client to send; after the answer a
// kept-alive connection goes back to the gate, so idle keep-alive connections hold no worker either.
// GET /health and GET /metrics go to a small pool of their own, so they are answered however busy the main pool
// is (every worker in an SSE stream, say). The routes themselves are added by http_server.cpp.
#pragma once
#include <httplib.h>

#include <memory>
#include <mutex>

#include "server/request_gate.h"

namespace kiln::server {

struct ServerOptions;

class ListeningServer : public httplib::Server {
 public:
  ListeningServer() = default;
  ~ListeningServer() override;

  // Raises the listen backlog of the bound socket (httplib's is 5: a burst of clients would see resets).
  void raise_backlog(int backlog);
  // The gate's limits and the worker pools (fixed: an open SSE stream holds one worker).
  void configure(const ServerOptions& o);
  // Stops the gate (closing the connections it holds), then waits for the workers' requests to end.
  void stop_gate();

 private:
  class InlineAdmission;
  void dispatch(std::unique_ptr<GateConnection> c);
  bool process_and_close_socket(socket_t sock) override;
  void serve(std::unique_ptr<GateConnection> c);

  int write_timeout_s_ = 60;
  std::unique_ptr<RequestGate> gate_;
  std::mutex pool_mu_;
  std::unique_ptr<httplib::ThreadPool> workers_, health_workers_;  // guarded by pool_mu_
};

// The connections the server may hold open at once: `requested`, or when 0 as many as the open-file limit leaves
// room for (after raising the soft limit to the hard one), at most 65536. Logs when it had to lower `requested`.
int resolve_max_connections(int requested);

}  // namespace kiln::server
