// Private to the TLS sessions (ibtrs/tls.h): what their files share (kernel: tls.h of net/tls).
//
// Files (one per concern):
//   tls.cc         contexts and sessions: the handshake over memory BIOs, the userspace record
//                  layer, the mode and description text
//   tls_kernel.cc  kernel TLS: the suites it takes, one direction's keys from the TLS 1.3 key
//                  schedule, the probe (kernel_tls_available)
//   tls_psk.cc     PSK files and keys, and what a valid PSK is
#pragma once

#include <linux/tls.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "ibtrs/tls.h"

// The kernel's values, for C library headers that lack them.
#ifndef SOL_TLS
#define SOL_TLS 282
#endif
#ifndef TCP_ULP
#define TCP_ULP 31
#endif

namespace ibtrs::tls {

// Printable ASCII without space: what a PSK identity may hold (checked on ours and the peer's).
inline bool printable(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

// tls_psk.cc
bool valid_psk(const Psk& p);

// tls_kernel.cc: a TLS 1.3 cipher suite the kernel's record layer takes.
struct Suite;
// The negotiated suite if the kernel takes it, else nullptr.
const Suite* suite_of(const SSL_CIPHER* c);
// Installs one direction's keys (TLS_TX or TLS_RX) in the kernel at record sequence 0.
bool install_kernel_keys(int fd, int direction, const Suite& s, const std::vector<unsigned char>& secret);

}  // namespace ibtrs::tls
