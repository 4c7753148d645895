// Notices a client that has gone away while its request waits or runs, so the engine can drop it.
//
// cpp-httplib 0.11 gives handlers no access to the connection's socket, and a streamed response
// only fails on its next write. So the probe finds the socket by its addresses (the only socket of
// this process whose local port and peer address match the request's) and asks the kernel whether
// the peer has closed or reset it.
#pragma once
#include <string>

namespace kiln::server {

class ConnectionProbe {
 public:
  ConnectionProbe() = default;
  // Finds the socket now, while the connection is surely open (a reset socket has no peer address).
  ConnectionProbe(std::string remote_addr, int remote_port, int local_port);
  // True when the peer closed or reset the connection (or it is no longer there).
  bool peer_gone();

 private:
  bool matches(int fd) const;
  void locate();
  std::string remote_addr_;
  int remote_port_ = -1;
  int local_port_ = -1;
  int fd_ = -1;
};

}  // namespace kiln::server
