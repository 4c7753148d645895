#include "server/connection_probe.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace kiln::server {

namespace {

// Address and port of a socket address, "" when it is not IPv4/IPv6.
bool addr_of(const sockaddr_storage& ss, std::string* addr, int* port) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, buf, sizeof(buf));
    *port = ntohs(in->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    *port = ntohs(in6->sin6_port);
  } else {
    return false;
  }
  *addr = buf;
  return true;
}

}  // namespace

ConnectionProbe::ConnectionProbe(std::string remote_addr, int remote_port, int local_port)
    : remote_addr_(std::move(remote_addr)), remote_port_(remote_port), local_port_(local_port) {
  locate();
}

bool ConnectionProbe::matches(int fd) const {
  sockaddr_storage peer{}, local{};
  socklen_t plen = sizeof(peer), llen = sizeof(local);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) return false;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &llen) != 0) return false;
  std::string paddr, laddr;
  int pport = -1, lport = -1;
  if (!addr_of(peer, &paddr, &pport) || !addr_of(local, &laddr, &lport)) return false;
  return pport == remote_port_ && lport == local_port_ && paddr == remote_addr_;
}

void ConnectionProbe::locate() {
  if (remote_port_ < 0) return;
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    int fd = std::atoi(e->d_name);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    if (matches(fd)) {
      fd_ = fd;
      break;
    }
  }
  closedir(dir);
}

bool ConnectionProbe::peer_gone() {
  if (fd_ < 0) return false;  // not found: cannot tell, assume present
  if (!matches(fd_)) return true;  // the socket was closed (and its number maybe reused)
  pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP)) return true;
  if (p.revents & POLLIN) {
    char c;
    ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0;  // orderly shutdown; > 0 is a pipelined next request
  }
  return false;
}

}  // namespace kiln::server
