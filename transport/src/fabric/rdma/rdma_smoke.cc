// Smoke test of the rdma provider on real devices (not part of the library). Meant for the VM
// rig (tests/vm), where rxe0/rxe1 sit on a veth pair at IBTRS_RDMA_ADDR_A / IBTRS_RDMA_ADDR_B.
//
// Build, from the repository root, against a library built with -DIBTRS_RDMA=ON (one line):
//   g++ -std=c++20 -O1 -g -Itransport/include -Itransport/src
//       transport/src/fabric/rdma/rdma_smoke.cc build-rdma/transport/libibtrs.a
//       -libverbs -lrdmacm -lpthread -o build-rdma/rdma_smoke
// Run:
//   tests/vm/run-in-vm.sh -- build-rdma/rdma_smoke
//
// Prints one line per check (PASS/FAIL) and exits 1 if any failed. The first section talks to
// librdmacm directly and reports the private data lengths the transport delivers, which is why
// the provider carries lengths itself (see rdma_private_data.h).
#include <arpa/inet.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "fabric/fabric.h"

using namespace ibtrs;
using namespace ibtrs::fabric;
using namespace std::chrono_literals;

namespace {

int g_failures = 0;
int g_passes = 0;

void check(bool ok, const std::string& name, const std::string& detail = {}) {
  if (ok) {
    ++g_passes;
    std::printf("PASS %s\n", name.c_str());
  } else {
    ++g_failures;
    std::printf("FAIL %s%s%s\n", name.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
  std::fflush(stdout);
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 131 + seed * 7 + (i >> 8)) & 0xff);
  return v;
}

// ------------------------------------------------------------------------------------------
// Raw librdmacm probe: what private_data_len does the transport report?

bool raw_event(rdma_event_channel* ch, rdma_cm_event_type want, rdma_cm_event** out, int ms = 5000) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    pollfd p{ch->fd, POLLIN, 0};
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now())
                                    .count());
    if (left <= 0 || ::poll(&p, 1, left) <= 0) return false;
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) != 0) return false;
    if (ev->event == want) {
      *out = ev;
      return true;
    }
    std::printf("  probe: unexpected %s (status %d)\n", rdma_event_str(ev->event), ev->status);
    rdma_ack_cm_event(ev);
    return false;
  }
}

// One connect attempt over raw rdma_cm without QPs; the passive side rejects or accepts with
// `reply_len` bytes. Prints the lengths seen on both sides.
void raw_probe(const Address& a, const Address& b, bool accept, uint8_t req_len, uint8_t reply_len) {
  rdma_event_channel* sch = rdma_create_event_channel();
  rdma_event_channel* cch = rdma_create_event_channel();
  rdma_cm_id* listen_id = nullptr;
  rdma_cm_id* cid = nullptr;
  rdma_cm_event* ev = nullptr;
  std::string tag = std::string("probe ") + (accept ? "accept" : "reject") +
                    " req=" + std::to_string(req_len) + " reply=" + std::to_string(reply_len);
  if (sch == nullptr || cch == nullptr) {
    check(false, tag, "rdma_create_event_channel");
    return;
  }
  sockaddr_storage lsa = b.with_port(0).sa;
  sockaddr_storage src = a.with_port(0).sa;
  rdma_create_id(sch, &listen_id, nullptr, RDMA_PS_TCP);
  bool ok = rdma_bind_addr(listen_id, reinterpret_cast<sockaddr*>(&lsa)) == 0 &&
            rdma_listen(listen_id, 4) == 0;
  sockaddr_storage dst = b.with_port(ntohs(rdma_get_src_port(listen_id))).sa;
  rdma_create_id(cch, &cid, nullptr, RDMA_PS_TCP);
  ok = ok && rdma_resolve_addr(cid, reinterpret_cast<sockaddr*>(&src), reinterpret_cast<sockaddr*>(&dst), 2000) == 0 &&
       raw_event(cch, RDMA_CM_EVENT_ADDR_RESOLVED, &ev);
  if (ok) rdma_ack_cm_event(ev);
  ok = ok && rdma_resolve_route(cid, 2000) == 0 && raw_event(cch, RDMA_CM_EVENT_ROUTE_RESOLVED, &ev);
  if (ok) rdma_ack_cm_event(ev);
  std::vector<uint8_t> req(req_len, 0xA5), reply(reply_len, 0x5A);
  rdma_conn_param cp{};
  cp.private_data = req.data();
  cp.private_data_len = req_len;
  cp.responder_resources = 3;
  cp.initiator_depth = 5;
  cp.retry_count = 7;
  cp.rnr_retry_count = 7;
  cp.qp_num = 0x123;
  ok = ok && rdma_connect(cid, &cp) == 0 && raw_event(sch, RDMA_CM_EVENT_CONNECT_REQUEST, &ev);
  if (!ok) {
    check(false, tag, "setup failed");
  } else {
    rdma_cm_id* child = ev->id;
    std::printf("  probe: CONNECT_REQUEST private_data_len=%u (sent %u); responder_resources=%u "
                "initiator_depth=%u (sent 3/5); transport=%s\n",
                ev->param.conn.private_data_len, req_len, ev->param.conn.responder_resources,
                ev->param.conn.initiator_depth,
                child->verbs->device->transport_type == IBV_TRANSPORT_IWARP ? "iwarp" : "ib/roce");
    rdma_ack_cm_event(ev);
    if (accept) {
      rdma_conn_param ap{};
      ap.private_data = reply.data();
      ap.private_data_len = reply_len;
      ap.responder_resources = 1;
      ap.initiator_depth = 1;
      ap.rnr_retry_count = 7;
      ap.qp_num = 0x456;
      rdma_accept(child, &ap);
      if (raw_event(cch, RDMA_CM_EVENT_CONNECT_RESPONSE, &ev)) {
        std::printf("  probe: CONNECT_RESPONSE private_data_len=%u (sent %u)\n",
                    ev->param.conn.private_data_len, reply_len);
        rdma_ack_cm_event(ev);
        check(true, tag);
      } else {
        check(false, tag, "no CONNECT_RESPONSE");
      }
    } else {
      rdma_reject(child, reply.data(), reply_len);
      if (raw_event(cch, RDMA_CM_EVENT_REJECTED, &ev)) {
        std::printf("  probe: REJECTED status=%d private_data_len=%u (sent %u)\n", ev->status,
                    ev->param.conn.private_data_len, reply_len);
        rdma_ack_cm_event(ev);
        check(true, tag);
      } else {
        check(false, tag, "no REJECTED");
      }
    }
    rdma_destroy_id(child);
  }
  rdma_destroy_id(cid);
  rdma_destroy_id(listen_id);
  rdma_destroy_event_channel(cch);
  rdma_destroy_event_channel(sch);
}

// ------------------------------------------------------------------------------------------
// Provider checks.

struct Buf {
  std::vector<std::byte> bytes;
  std::unique_ptr<MemoryRegion> mr;
  Buf(Domain& d, size_t n, uint32_t access, std::byte fill = std::byte{0}) : bytes(n, fill) {
    auto r = d.register_memory(bytes.data(), n, access);
    if (!r) {
      std::printf("register_memory(%zu): %s\n", n, r.error().message().c_str());
      std::exit(2);
    }
    mr = std::move(r).value();
  }
  Sge sge(size_t off, size_t len) const { return mr->sge(off, static_cast<uint32_t>(len)); }
};

struct End {
  Domain* domain = nullptr;
  std::unique_ptr<CompletionQueue> cq;
  std::unique_ptr<Connection> conn;
  std::vector<Completion> done;
  std::atomic<int> disconnects{0};
  std::atomic<int> last_error{0};
  std::vector<std::byte> peer_pd;

  ConnectionEvents events() {
    return ConnectionEvents{[this](std::error_code ec) {
      last_error = ec.value();
      disconnects.fetch_add(1);
    }};
  }
  void poll() {
    Completion wc[64];
    size_t n = cq->poll(wc);
    done.insert(done.end(), wc, wc + n);
  }
};

bool drive(End& a, End& b, const std::function<bool()>& pred, std::chrono::milliseconds timeout = 10s) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    a.poll();
    b.poll();
  }
  return true;
}

struct Rig {
  Address a, b;
  std::unique_ptr<Fabric> server_fabric, client_fabric;
  std::unique_ptr<Listener> listener;
  Domain* server_domain = nullptr;
  Domain* client_domain = nullptr;

  // Connects a fresh pair; false on failure (reported).
  bool connect(End& cli, End& srv, const QueueCaps& caps, std::span<const std::byte> req,
               std::span<const std::byte> rsp, const std::string& name) {
    cli.domain = client_domain;
    srv.domain = server_domain;
    if (!cli.cq) cli.cq = std::move(client_domain->create_cq(4096)).value();
    if (!srv.cq) srv.cq = std::move(server_domain->create_cq(4096)).value();
    std::vector<std::byte> rsp_copy(rsp.begin(), rsp.end());
    auto server = std::async(std::launch::async, [&]() -> Result<std::unique_ptr<Connection>> {
      auto r = listener->get_request(10s);
      if (!r) return r.error();
      srv.peer_pd.assign((*r)->private_data().begin(), (*r)->private_data().end());
      if (&(*r)->domain() != server_domain) std::printf("  request domain != server domain\n");
      return (*r)->accept(*srv.cq, caps, rsp_copy, srv.events());
    });
    ConnectParams p;
    p.remote = listener->address();
    p.source = &a;
    p.cq = cli.cq.get();
    p.caps = caps;
    p.private_data = req;
    p.events = cli.events();
    p.timeout = 10s;
    auto c = client_domain->connect(p);
    auto s = server.get();
    if (!c || !s) {
      check(false, name, std::string("connect: ") + (c ? "ok" : c.error().message()) +
                             ", accept: " + (s ? "ok" : s.error().message()));
      return false;
    }
    cli.conn = std::move(c->connection);
    cli.peer_pd = c->private_data;
    srv.conn = std::move(s).value();
    return true;
  }
};

void test_private_data(Rig& rig) {
  for (size_t req_len : {size_t{0}, size_t{1}, size_t{3}, size_t{8}, size_t{55}, size_t{56}}) {
    for (size_t rsp_len : {size_t{0}, size_t{5}, size_t{56}}) {
      End cli, srv;
      auto req = pattern(req_len, 1 + static_cast<uint32_t>(req_len));
      auto rsp = pattern(rsp_len, 100 + static_cast<uint32_t>(rsp_len));
      std::string name = "private data exact: connect " + std::to_string(req_len) + " B, accept " +
                         std::to_string(rsp_len) + " B";
      if (!rig.connect(cli, srv, {}, req, rsp, name)) continue;
      check(srv.peer_pd == req && cli.peer_pd == rsp, name,
            "server got " + std::to_string(srv.peer_pd.size()) + " B, client got " +
                std::to_string(cli.peer_pd.size()) + " B");
    }
  }
  // Over the limit: EINVAL before anything is sent.
  {
    auto cq = std::move(rig.client_domain->create_cq(256)).value();
    std::vector<std::byte> big(kMaxPrivateData + 1);
    ConnectParams p;
    p.remote = rig.listener->address();
    p.source = &rig.a;
    p.cq = cq.get();
    p.private_data = big;
    p.timeout = 2s;
    auto r = rig.client_domain->connect(p);
    check(!r && r.error() == errc(EINVAL), "57 bytes of connect private data is EINVAL");
  }
}

void test_reject(Rig& rig) {
  auto cq = std::move(rig.client_domain->create_cq(256)).value();
  auto reject_pd = pattern(25, 9);
  auto hello = pattern(3, 4);
  size_t seen = 0;
  std::thread srv([&] {
    auto req = rig.listener->get_request(10s);
    if (!req) return;
    seen = (*req)->private_data().size();
    (void)(*req)->reject(reject_pd);
  });
  ConnectParams p;
  p.remote = rig.listener->address();
  p.source = &rig.a;
  p.cq = cq.get();
  p.private_data = hello;
  p.timeout = 10s;
  std::vector<std::byte> got;
  auto r = rig.client_domain->connect(p, &got);
  srv.join();
  check(!r && r.error() == errc(ECONNREFUSED) && got == reject_pd && seen == 3,
        "reject: ECONNREFUSED with exact reject data",
        std::string(r ? "connected" : r.error().message()) + ", reject data " +
            std::to_string(got.size()) + " B, request data " + std::to_string(seen) + " B");
}

void test_unreachable(Rig& rig) {
  auto cq = std::move(rig.client_domain->create_cq(256)).value();
  {
    ConnectParams p;
    p.remote = rig.listener->address().with_port(static_cast<uint16_t>(rig.listener->address().port + 1));
    p.source = &rig.a;
    p.cq = cq.get();
    p.timeout = 5s;
    auto t0 = std::chrono::steady_clock::now();
    auto r = rig.client_domain->connect(p);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    check(!r && r.error() == errc(ECONNREFUSED), "connect to a port nobody listens on: ECONNREFUSED",
          (r ? std::string("connected") : r.error().message()) + " after " + std::to_string(ms) + " ms");
  }
  {
    // 198.18.0.3: inside the rig's /24, no such host (ARP fails).
    auto nowhere = Address::parse("rdma:198.18.0.3:1234");
    ConnectParams p;
    p.remote = *nowhere;
    p.source = &rig.a;
    p.cq = cq.get();
    p.timeout = 5s;
    auto t0 = std::chrono::steady_clock::now();
    auto r = rig.client_domain->connect(p);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    check(!r && (r.error() == errc(EHOSTUNREACH) || r.error() == errc(ETIMEDOUT)) && ms < 6000,
          "connect to a host that does not exist: EHOSTUNREACH/ETIMEDOUT within the timeout",
          (r ? std::string("connected") : r.error().message()) + " after " + std::to_string(ms) + " ms");
  }
}

std::vector<size_t> sizes_1b_to_1mib() {
  std::vector<size_t> v;
  for (size_t s = 1; s <= (1u << 20); s *= 2) {
    v.push_back(s);
    if (s >= 4 && s < (1u << 20)) v.push_back(s + s / 2 + 1);
  }
  return v;
}

std::string read_counter(const std::string& dev, const char* name) {
  std::string path = "/sys/class/infiniband/" + dev + "/ports/1/hw_counters/" + name;
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return "?";
  char buf[64] = {};
  if (std::fgets(buf, sizeof(buf), f) == nullptr) buf[0] = 0;
  std::fclose(f);
  std::string v(buf);
  while (!v.empty() && (v.back() == '\n' || v.back() == ' ')) v.pop_back();
  return v;
}

void print_rnr_counters() {
  for (const char* dev : {"rxe0", "rxe1"}) {
    std::printf("  %s: rcvd_rnr_err=%s send_rnr_err=%s retry_rnr_exceeded_err=%s retry_exceeded_err=%s "
                "rcvd_seq_err=%s duplicate_request=%s out_of_sequence=%s\n",
                dev, read_counter(dev, "rcvd_rnr_err").c_str(), read_counter(dev, "send_rnr_err").c_str(),
                read_counter(dev, "retry_rnr_exceeded_err").c_str(),
                read_counter(dev, "retry_exceeded_err").c_str(), read_counter(dev, "rcvd_seq_err").c_str(),
                read_counter(dev, "duplicate_request").c_str(), read_counter(dev, "out_of_sequence").c_str());
  }
}

void test_datapath(Rig& rig) {
  End cli, srv;
  QueueCaps caps{128, 128, 4, 2};
  auto req = pattern(56, 11), rsp = pattern(56, 12);
  if (!rig.connect(cli, srv, caps, req, rsp, "datapath connect")) return;
  check(srv.peer_pd == req && cli.peer_pd == rsp, "datapath connect: 56 B private data both ways");
  check(cli.conn->state() == ConnState::connected && srv.conn->state() == ConnState::connected,
        "both ends connected");
  std::printf("  client: %s port %u, %s -> %s; server: %s port %u, %s -> %s\n",
              cli.conn->device_name().c_str(), cli.conn->port_num(),
              cli.conn->local_address().to_string().c_str(), cli.conn->peer_address().to_string().c_str(),
              srv.conn->device_name().c_str(), srv.conn->port_num(),
              srv.conn->local_address().to_string().c_str(), srv.conn->peer_address().to_string().c_str());
  check(cli.conn->device_name() != srv.conn->device_name(), "client and server on different devices",
        cli.conn->device_name() + " / " + srv.conn->device_name());

  constexpr size_t kMax = 1 << 20;
  const auto sizes = sizes_1b_to_1mib();
  Buf src(*rig.client_domain, kMax, 0);
  Buf rx(*rig.server_domain, kMax, kLocalWrite);
  Buf target(*rig.server_domain, kMax + 4096, kRemoteWrite, std::byte{0xEE});

  // SEND of every size into a 1 MiB RECV.
  {
    bool all = true;
    std::string why;
    for (size_t size : sizes) {
      auto data = pattern(size, static_cast<uint32_t>(size));
      std::memcpy(src.bytes.data(), data.data(), size);
      std::fill(rx.bytes.begin(), rx.bytes.end(), std::byte{0});
      Sge rs = rx.sge(0, kMax);
      RecvWr r{size, {&rs, 1}};
      Sge ss = src.sge(0, size);
      SendWr w{size + 1, Opcode::send, {&ss, 1}};
      if (!srv.conn->post_recv({&r, 1}).ok() || !cli.conn->post_send({&w, 1}).ok()) {
        all = false;
        why = "post failed at " + std::to_string(size);
        break;
      }
      size_t c0 = cli.done.size(), s0 = srv.done.size();
      if (!drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; })) {
        all = false;
        why = "no completion at " + std::to_string(size);
        break;
      }
      const Completion& sc = cli.done.back();
      const Completion& rc = srv.done.back();
      bool ok = sc.status == WcStatus::success && sc.opcode == Opcode::send && sc.wr_id == size + 1 &&
                rc.status == WcStatus::success && rc.opcode == Opcode::recv && rc.wr_id == size &&
                rc.byte_len == size && !rc.with_imm &&
                std::memcmp(rx.bytes.data(), data.data(), size) == 0 &&
                (size == kMax || rx.bytes[size] == std::byte{0});
      if (!ok) {
        all = false;
        why = "mismatch at " + std::to_string(size) + " (send " + std::string(to_string(sc.status)) +
              ", recv " + std::string(to_string(rc.status)) + " len " + std::to_string(rc.byte_len) + ")";
        break;
      }
    }
    check(all, "SEND 1 B .. 1 MiB byte-exact (" + std::to_string(sizes.size()) + " sizes)", why);
  }

  // WRITE of every size at an odd offset; guard bytes around it untouched.
  {
    bool all = true;
    std::string why;
    for (size_t size : sizes) {
      auto data = pattern(size, static_cast<uint32_t>(size) + 3);
      std::memcpy(src.bytes.data(), data.data(), size);
      std::fill(target.bytes.begin(), target.bytes.end(), std::byte{0xEE});
      const size_t off = 17 + size % 7;
      Sge ss = src.sge(0, size);
      SendWr w{size, Opcode::write, {&ss, 1}, target.mr->remote_addr(off), target.mr->rkey()};
      if (!cli.conn->post_send({&w, 1}).ok()) {
        all = false;
        why = "post failed at " + std::to_string(size);
        break;
      }
      size_t c0 = cli.done.size();
      if (!drive(cli, srv, [&] { return cli.done.size() == c0 + 1; })) {
        all = false;
        why = "no completion at " + std::to_string(size);
        break;
      }
      const Completion& c = cli.done.back();
      bool guards = std::all_of(target.bytes.begin(), target.bytes.begin() + off,
                                [](std::byte b) { return b == std::byte{0xEE}; }) &&
                    std::all_of(target.bytes.begin() + off + size, target.bytes.end(),
                                [](std::byte b) { return b == std::byte{0xEE}; });
      if (c.status != WcStatus::success || c.opcode != Opcode::write || c.wr_id != size ||
          std::memcmp(target.bytes.data() + off, data.data(), size) != 0 || !guards) {
        all = false;
        why = "mismatch at " + std::to_string(size) + " (" + std::string(to_string(c.status)) + ")";
        break;
      }
    }
    check(all && srv.done.size() == sizes.size(),
          "WRITE 1 B .. 1 MiB byte-exact, guards untouched, no target completion", why);
  }

  // WRITE_WITH_IMM of every size: placed, then consumes a RECV carrying the immediate.
  {
    bool all = true;
    std::string why;
    for (size_t size : sizes) {
      auto data = pattern(size, static_cast<uint32_t>(size) + 5);
      std::memcpy(src.bytes.data(), data.data(), size);
      Sge rs = rx.sge(0, 16);
      RecvWr r{size, {&rs, 1}};
      const uint32_t imm = 0x80000000u | static_cast<uint32_t>(size);
      Sge ss = src.sge(0, size);
      SendWr w{size, Opcode::write_with_imm, {&ss, 1}, target.mr->remote_addr(64),
               target.mr->rkey(), imm};
      if (!srv.conn->post_recv({&r, 1}).ok() || !cli.conn->post_send({&w, 1}).ok()) {
        all = false;
        why = "post failed at " + std::to_string(size);
        break;
      }
      size_t c0 = cli.done.size(), s0 = srv.done.size();
      if (!drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; })) {
        all = false;
        why = "no completion at " + std::to_string(size);
        break;
      }
      const Completion& sc = cli.done.back();
      const Completion& rc = srv.done.back();
      if (sc.status != WcStatus::success || sc.opcode != Opcode::write_with_imm ||
          rc.status != WcStatus::success || rc.opcode != Opcode::recv_rdma_with_imm ||
          !rc.with_imm || rc.imm != imm || rc.byte_len != size || rc.wr_id != size ||
          std::memcmp(target.bytes.data() + 64, data.data(), size) != 0) {
        all = false;
        why = "mismatch at " + std::to_string(size) + " (send " + std::string(to_string(sc.status)) +
              "/" + std::string(to_string(sc.opcode)) + ", recv " + std::string(to_string(rc.status)) +
              "/" + std::string(to_string(rc.opcode)) + " imm " + std::to_string(rc.imm) + ")";
        break;
      }
    }
    check(all, "WRITE_WITH_IMM 1 B .. 1 MiB: bytes, immediate, byte_len, opcodes", why);
  }

  // Zero-length WRITE_WITH_IMM with rkey 0 and a RECV without SGEs (the heartbeat shape).
  {
    RecvWr r{5, {}};
    SendWr w{6, Opcode::write_with_imm, {}, 0, 0, 0xFFFFFFFFu};
    bool posted = srv.conn->post_recv({&r, 1}).ok() && cli.conn->post_send({&w, 1}).ok();
    size_t c0 = cli.done.size(), s0 = srv.done.size();
    bool done = posted && drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; });
    check(done && cli.done.back().status == WcStatus::success &&
              srv.done.back().status == WcStatus::success && srv.done.back().imm == 0xFFFFFFFFu &&
              srv.done.back().byte_len == 0,
          "zero-length WRITE_WITH_IMM, rkey 0");
  }

  // Gather: 4 SGEs into one WRITE_WITH_IMM; scatter: 2 SGEs of a RECV.
  {
    Buf a(*rig.client_domain, 10000, 0), b(*rig.client_domain, 10000, 0);
    auto pa = pattern(10000, 21), pb = pattern(10000, 22);
    std::memcpy(a.bytes.data(), pa.data(), 10000);
    std::memcpy(b.bytes.data(), pb.data(), 10000);
    Sge sg[4] = {a.sge(0, 1), b.sge(5, 4096), a.sge(100, 5000), b.sge(0, 33)};
    Sge rs = rx.sge(0, 16);
    RecvWr r{7, {&rs, 1}};
    SendWr w{8, Opcode::write_with_imm, sg, target.mr->remote_addr(128), target.mr->rkey(), 42};
    bool posted = srv.conn->post_recv({&r, 1}).ok() && cli.conn->post_send({&w, 1}).ok();
    size_t c0 = cli.done.size(), s0 = srv.done.size();
    bool done = posted && drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; });
    std::vector<std::byte> expect;
    expect.insert(expect.end(), pa.begin(), pa.begin() + 1);
    expect.insert(expect.end(), pb.begin() + 5, pb.begin() + 5 + 4096);
    expect.insert(expect.end(), pa.begin() + 100, pa.begin() + 5100);
    expect.insert(expect.end(), pb.begin(), pb.begin() + 33);
    check(done && srv.done.back().byte_len == expect.size() &&
              std::memcmp(target.bytes.data() + 128, expect.data(), expect.size()) == 0,
          "WRITE_WITH_IMM gathering 4 SGEs");

    Sge rs2[2] = {rx.sge(0, 10), rx.sge(1000, 100)};
    RecvWr r2{9, rs2};
    Sge ss = a.sge(0, 50);
    SendWr w2{10, Opcode::send, {&ss, 1}};
    std::fill(rx.bytes.begin(), rx.bytes.end(), std::byte{0});
    posted = srv.conn->post_recv({&r2, 1}).ok() && cli.conn->post_send({&w2, 1}).ok();
    c0 = cli.done.size();
    s0 = srv.done.size();
    done = posted && drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; });
    check(done && srv.done.back().byte_len == 50 && std::memcmp(rx.bytes.data(), pa.data(), 10) == 0 &&
              std::memcmp(rx.bytes.data() + 1000, pa.data() + 10, 40) == 0,
          "RECV scattering over 2 SGEs");
  }

  // Receiver not ready: the SEND waits (infinite RNR retry) until a RECV is posted.
  {
    Sge ss = src.sge(0, 64);
    SendWr w{11, Opcode::send, {&ss, 1}};
    bool posted = cli.conn->post_send({&w, 1}).ok();
    size_t c0 = cli.done.size(), s0 = srv.done.size();
    bool early = drive(cli, srv, [&] { return cli.done.size() > c0; }, 500ms);
    Sge rs = rx.sge(0, 64);
    RecvWr r{12, {&rs, 1}};
    posted = posted && srv.conn->post_recv({&r, 1}).ok();
    auto t0 = std::chrono::steady_clock::now();
    bool done = posted && drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; });
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    if (!done) {
      print_rnr_counters();
      bool later = drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; }, 60s);
      auto ms2 = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
      std::printf("  RNR stall: %s after %lld ms (client %zu new, server %zu new)\n",
                  later ? "completed" : "still pending", static_cast<long long>(ms2),
                  cli.done.size() - c0, srv.done.size() - s0);
      print_rnr_counters();
    }
    check(!early && done && cli.done.back().status == WcStatus::success,
          "SEND waits for a RECV (RNR retry), then completes", std::to_string(ms) + " ms");
  }

  // Selective signalling: 100 WRITEs, every 10th signalled; the queue drains completely.
  {
    End c2, s2;
    QueueCaps caps2{100, 4, 1, 1};
    if (rig.connect(c2, s2, caps2, {}, {}, "selective signalling connect")) {
      Sge ss = src.sge(0, 4096);
      std::vector<SendWr> wrs;
      for (int i = 0; i < 100; ++i)
        wrs.push_back(SendWr{static_cast<uint64_t>(i), Opcode::write, {&ss, 1},
                             target.mr->remote_addr(0), target.mr->rkey(), 0, i % 10 == 9});
      bool posted = c2.conn->post_send(wrs).ok();
      bool full = c2.conn->send_queue_free() == 0;
      SendWr one{999, Opcode::write, {&ss, 1}, target.mr->remote_addr(0), target.mr->rkey()};
      bool enomem = c2.conn->post_send({&one, 1}).error() == errc(ENOMEM);
      bool ten = drive(c2, s2, [&] { return c2.done.size() == 10; });
      bool ids = ten;
      for (int i = 0; ten && i < 10; ++i) ids = ids && c2.done[i].wr_id == static_cast<uint64_t>(i * 10 + 9);
      bool freed = c2.conn->send_queue_free() == 100;
      check(posted && full && enomem && ids && freed,
            "selective signalling: 10 completions for 100 WRITEs, ENOMEM when full, all slots freed");
    }
  }

  // Disconnect with RECVs outstanding on both sides: all flush, both sides notified.
  {
    for (int i = 0; i < 5; ++i) {
      Sge cs = src.sge(i * 64, 64);
      RecvWr cr{static_cast<uint64_t>(500 + i), {&cs, 1}};
      (void)cli.conn->post_recv({&cr, 1});
      Sge srs = rx.sge(i * 64, 64);
      RecvWr sr{static_cast<uint64_t>(600 + i), {&srs, 1}};
      (void)srv.conn->post_recv({&sr, 1});
    }
    size_t c0 = cli.done.size(), s0 = srv.done.size();
    cli.conn->disconnect();
    cli.conn->disconnect();  // idempotent
    bool flushed = drive(cli, srv, [&] { return cli.done.size() == c0 + 5 && srv.done.size() == s0 + 5; }, 20s);
    bool all_flush = flushed;
    for (size_t i = c0; flushed && i < cli.done.size(); ++i) all_flush = all_flush && cli.done[i].status == WcStatus::flush_error;
    for (size_t i = s0; flushed && i < srv.done.size(); ++i) all_flush = all_flush && srv.done[i].status == WcStatus::flush_error;
    bool notified = drive(cli, srv, [&] { return cli.disconnects == 1 && srv.disconnects == 1; }, 20s);
    check(all_flush, "disconnect(): every outstanding RECV flushes on both sides",
          "client " + std::to_string(cli.done.size() - c0) + "/5, server " +
              std::to_string(srv.done.size() - s0) + "/5");
    check(notified && cli.conn->state() == ConnState::closed && srv.conn->state() == ConnState::error,
          "disconnect(): on_disconnected once on both sides; client closed, server error",
          "client " + std::to_string(cli.disconnects.load()) + " (" + std::to_string(cli.last_error.load()) +
              "), server " + std::to_string(srv.disconnects.load()) + " (" +
              std::to_string(srv.last_error.load()) + ")");
    Sge ss = src.sge(0, 1);
    SendWr w{1, Opcode::send, {&ss, 1}};
    check(cli.conn->post_send({&w, 1}).error() == errc(ENOTCONN) &&
              srv.conn->post_send({}).error() == errc(ENOTCONN),
          "posting after disconnect is ENOTCONN");
  }
}

void test_bad_keys(Rig& rig) {
  // Bad rkey: remote_access_error at the sender, later request flushes, target untouched.
  {
    End cli, srv;
    if (!rig.connect(cli, srv, {}, {}, {}, "bad rkey connect")) return;
    Buf target(*rig.server_domain, 8192, kRemoteWrite, std::byte{0x5A});
    Buf src(*rig.client_domain, 4096, 0, std::byte{0x11});
    Sge s = src.sge(0, 4096);
    SendWr wrs[2] = {
        SendWr{1, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey() ^ 0x5555u},
        SendWr{2, Opcode::write, {&s, 1}, target.mr->remote_addr(0), target.mr->rkey()}};
    bool posted = cli.conn->post_send(wrs).ok();
    bool done = posted && drive(cli, srv, [&] { return cli.done.size() == 2; });
    bool untouched = std::all_of(target.bytes.begin(), target.bytes.end(), [](std::byte b) { return b == std::byte{0x5A}; });
    check(done && cli.done[0].wr_id == 1 && cli.done[0].status == WcStatus::remote_access_error &&
              cli.done[1].wr_id == 2 && cli.done[1].status == WcStatus::flush_error && untouched,
          "bad rkey: remote_access_error, next request flushes, target untouched",
          done ? std::string(to_string(cli.done[0].status)) + "/" + std::string(to_string(cli.done[1].status)) : "no completions");
    bool broken = drive(cli, srv, [&] { return cli.conn->state() != ConnState::connected; });
    bool notified = drive(cli, srv, [&] { return cli.disconnects == 1 && srv.disconnects == 1; }, 20s);
    check(broken && notified, "bad rkey: connection goes to error and both sides are notified");
  }
  // Out of bounds by one byte, and a region without REMOTE_WRITE.
  for (int variant = 0; variant < 2; ++variant) {
    End cli, srv;
    if (!rig.connect(cli, srv, {}, {}, {}, "bounds connect")) return;
    Buf target(*rig.server_domain, 8192, variant == 0 ? kRemoteWrite : kLocalWrite, std::byte{0x5A});
    Buf src(*rig.client_domain, 4096, 0, std::byte{0x11});
    Sge s = src.sge(0, 4096);
    SendWr w{1, Opcode::write, {&s, 1}, target.mr->remote_addr(variant == 0 ? 8192 - 4095 : 0), target.mr->rkey()};
    bool done = cli.conn->post_send({&w, 1}).ok() && drive(cli, srv, [&] { return cli.done.size() == 1; });
    bool untouched = std::all_of(target.bytes.begin(), target.bytes.end(), [](std::byte b) { return b == std::byte{0x5A}; });
    check(done && cli.done[0].status == WcStatus::remote_access_error && untouched,
          variant == 0 ? "WRITE one byte out of bounds: remote_access_error, target untouched"
                       : "WRITE without REMOTE_WRITE access: remote_access_error, target untouched");
  }
  // Bad lkey on a small (inline-sized) SEND: the provider must not send it inline.
  {
    End cli, srv;
    if (!rig.connect(cli, srv, {}, {}, {}, "bad lkey connect")) return;
    Buf rx(*rig.server_domain, 64, kLocalWrite);
    Buf src(*rig.client_domain, 64, 0);
    Sge rs = rx.sge(0, 64);
    RecvWr r{1, {&rs, 1}};
    Sge ss = src.sge(0, 32);
    ss.lkey ^= 0x77u;
    SendWr w{2, Opcode::send, {&ss, 1}};
    bool done = srv.conn->post_recv({&r, 1}).ok() && cli.conn->post_send({&w, 1}).ok() &&
                drive(cli, srv, [&] { return cli.done.size() == 1; });
    // Sent inline it would succeed (the CPU copies, no lkey check). rxe reports the local error
    // as flush_error: rxe_qp_error() moves the QP to ERR before the completer reports the WQE,
    // and the completer then flushes every WQE (rxe_completer -> flush_send_queue).
    bool rejected = done && (cli.done[0].status == WcStatus::local_protection_error ||
                             cli.done[0].status == WcStatus::flush_error);
    bool nothing_arrived = std::none_of(srv.done.begin(), srv.done.end(),
                                        [](const Completion& c) { return c.status == WcStatus::success; });
    check(rejected && nothing_arrived,
          "SEND of 32 B with a bad lkey is not sent (not inlined past the lkey check)",
          done ? std::string("sender ") + std::string(to_string(cli.done[0].status)) : "no completion");
  }
  // SEND larger than the RECV.
  {
    End cli, srv;
    if (!rig.connect(cli, srv, {}, {}, {}, "length connect")) return;
    Buf rx(*rig.server_domain, 100, kLocalWrite);
    Buf src(*rig.client_domain, 200, 0);
    Sge rs = rx.sge(0, 100);
    RecvWr r{1, {&rs, 1}};
    Sge ss = src.sge(0, 200);
    SendWr w{2, Opcode::send, {&ss, 1}};
    bool done = srv.conn->post_recv({&r, 1}).ok() && cli.conn->post_send({&w, 1}).ok() &&
                drive(cli, srv, [&] { return cli.done.size() == 1 && !srv.done.empty(); });
    // rxe's copy_data() returns -EINVAL, not -ENOSPC, when the message exceeds the whole RECV
    // (length > resid), so it answers MALFORMED_WQE: LOC_QP_OP_ERR here (fatal_error), NAK
    // REM_OP_ERR to the sender. HCAs report LOC_LEN_ERR / REM_INV_REQ_ERR.
    bool spec = done && srv.done[0].status == WcStatus::local_length_error &&
                cli.done[0].status == WcStatus::remote_invalid_request;
    bool rxe = done && srv.done[0].status == WcStatus::fatal_error &&
               cli.done[0].status == WcStatus::remote_operation_error;
    check(spec || rxe, "SEND larger than the RECV fails at both ends (spec or rxe statuses)",
          done ? std::string(to_string(srv.done[0].status)) + " / " + std::string(to_string(cli.done[0].status)) : "no completions");
  }
}

void test_peer_death(Rig& rig) {
  End cli, srv;
  QueueCaps caps{32, 32, 1, 1};
  if (!rig.connect(cli, srv, caps, {}, {}, "peer death connect")) return;
  Buf rx(*rig.client_domain, 20 * 64, kLocalWrite);
  Buf tx(*rig.client_domain, 64, 0);
  for (int i = 0; i < 20; ++i) {
    Sge s = rx.sge(i * 64, 64);
    RecvWr r{static_cast<uint64_t>(i), {&s, 1}};
    (void)cli.conn->post_recv({&r, 1});
  }
  Sge ts = tx.sge(0, 64);
  for (int i = 0; i < 10; ++i) {
    SendWr w{static_cast<uint64_t>(100 + i), Opcode::send, {&ts, 1}, 0, 0, 0, i % 3 == 0};
    (void)cli.conn->post_send({&w, 1});
  }
  drive(cli, srv, [] { return false; }, 100ms);
  auto t0 = std::chrono::steady_clock::now();
  srv.conn.reset();
  bool all = drive(cli, srv, [&] { return cli.done.size() == 30; }, 20s);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  size_t flushes = 0;
  for (auto& c : cli.done) flushes += c.status == WcStatus::flush_error ? 1 : 0;
  bool notified = drive(cli, srv, [&] { return cli.disconnects == 1; }, 10s);
  check(all && flushes == 30 && notified && cli.conn->post_send({}).error() == errc(ENOTCONN),
        "peer destroyed: 30 outstanding (20 RECV, 10 SEND, some unsignalled) flush, on_disconnected once",
        std::to_string(cli.done.size()) + " completions, " + std::to_string(flushes) + " flushes, " +
            std::to_string(cli.disconnects.load()) + " notifications, " + std::to_string(ms) + " ms");
}

void test_cq_capacity(Rig& rig) {
  End cli, srv;
  cli.domain = rig.client_domain;
  cli.cq = std::move(rig.client_domain->create_cq(100)).value();
  QueueCaps caps{64, 64, 1, 1};  // 128 > 100
  ConnectParams p;
  p.remote = rig.listener->address();
  p.source = &rig.a;
  p.cq = cli.cq.get();
  p.caps = caps;
  p.timeout = 5s;
  auto r = rig.client_domain->connect(p);
  check(!r && r.error() == errc(ENOSPC), "CQ too small for the queues: ENOSPC",
        r ? "connected" : r.error().message());
}

void test_many_connections(Rig& rig) {
  // Open and tear down connections repeatedly, destroying in both orders, to shake out
  // teardown races with the cm event thread.
  bool all = true;
  for (int round = 0; round < 20 && all; ++round) {
    End cli, srv;
    if (!rig.connect(cli, srv, {}, {}, {}, "churn connect " + std::to_string(round))) {
      all = false;
      break;
    }
    if (round % 3 == 0) cli.conn->disconnect();
    if (round % 2 == 0) {
      cli.conn.reset();
      srv.conn.reset();
    } else {
      srv.conn.reset();
      cli.conn.reset();
    }
  }
  check(all, "20 connect/teardown rounds without hang");
}

// Receiver-not-ready, repeated: how long the SEND takes once the RECV is there.
void test_rnr_loop(Rig& rig, int rounds, std::chrono::milliseconds early) {
  End cli, srv;
  if (!rig.connect(cli, srv, {}, {}, {}, "rnr connect")) return;
  Buf rx(*rig.server_domain, 4096, kLocalWrite);
  Buf src(*rig.client_domain, 4096, 0, std::byte{0x42});
  int good = 0;
  for (int i = 0; i < rounds; ++i) {
    Sge ss = src.sge(0, 64 + (i % 2) * 1000);  // inline-sized and not
    SendWr w{static_cast<uint64_t>(i), Opcode::send, {&ss, 1}};
    (void)cli.conn->post_send({&w, 1});
    size_t c0 = cli.done.size(), s0 = srv.done.size();
    bool early_done = drive(cli, srv, [&] { return cli.done.size() > c0; }, early);
    auto t0 = std::chrono::steady_clock::now();
    Sge rs = rx.sge(0, 4096);
    RecvWr r{static_cast<uint64_t>(i), {&rs, 1}};
    (void)srv.conn->post_recv({&r, 1});
    bool done = drive(cli, srv, [&] { return cli.done.size() == c0 + 1 && srv.done.size() == s0 + 1; }, 20s);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
    std::printf("  rnr round %d (%zu B, early wait %lld ms): %s after %lld ms%s\n", i, size_t{ss.length},
                static_cast<long long>(early.count()), done ? "completed" : "NOT completed",
                static_cast<long long>(ms), early_done ? " (completed before the RECV!)" : "");
    if (done && !early_done) ++good;
    if (!done) {
      print_rnr_counters();
      break;
    }
  }
  check(good == rounds, "RNR loop: " + std::to_string(good) + "/" + std::to_string(rounds) +
                            " SENDs waited for their RECV and completed");
}

}  // namespace

int main(int argc, char** argv) {
  auto a = Address::parse("rdma:" + env_or("IBTRS_RDMA_ADDR_A", "198.18.0.1") + ":0");
  auto b = Address::parse("rdma:" + env_or("IBTRS_RDMA_ADDR_B", "198.18.0.2") + ":0");
  if (!a || !b) {
    std::printf("bad IBTRS_RDMA_ADDR_A/B\n");
    return 2;
  }
  auto sf = open_fabric(FabricKind::rdma);
  if (!sf) {
    std::printf("SKIP: rdma fabric unavailable: %s\n", sf.error().message().c_str());
    return 77;
  }

  std::printf("== raw rdma_cm: private data lengths as the transport reports them\n");
  raw_probe(*a, *b, false, 10, 5);
  raw_probe(*a, *b, true, 10, 7);
  raw_probe(*a, *b, true, 56, 56);

  Rig rig;
  rig.a = *a;
  rig.b = *b;
  rig.server_fabric = std::move(sf).value();
  auto cf = open_fabric(FabricKind::rdma);
  if (!cf) {
    std::printf("second fabric: %s\n", cf.error().message().c_str());
    return 1;
  }
  rig.client_fabric = std::move(cf).value();
  auto l = rig.server_fabric->listen(*b);
  check(l.ok(), "listen on " + b->to_string(), l ? "" : l.error().message());
  if (!l) return 1;
  rig.listener = std::move(l).value();
  check(rig.listener->address().port != 0, "listener reports its port",
        rig.listener->address().to_string());
  auto sd = rig.server_fabric->domain_for(rig.listener->address());
  auto cd = rig.client_fabric->domain_for(rig.listener->address(), &rig.a);
  check(sd.ok() && cd.ok(), "domain_for server and client",
        std::string(sd ? (*sd)->device_name() : sd.error().message()) + " / " +
            (cd ? (*cd)->device_name() : cd.error().message()));
  if (!sd || !cd) return 1;
  rig.server_domain = *sd;
  rig.client_domain = *cd;
  std::printf("  server domain %s, client domain %s\n", rig.server_domain->device_name().c_str(),
              rig.client_domain->device_name().c_str());
  auto again = rig.server_fabric->domain_for(rig.listener->address());
  check(again.ok() && *again == rig.server_domain, "domain_for is stable for one device");

  {
    std::byte b16[16];
    check(rig.server_domain->register_memory(nullptr, 16, kLocalWrite).error() == errc(EINVAL) &&
              rig.server_domain->register_memory(b16, 0, kLocalWrite).error() == errc(EINVAL) &&
              rig.server_domain->register_memory(b16, 16, 1u << 20).error() == errc(EINVAL),
          "register_memory rejects null / zero length / unknown access bits");
  }

  if (argc > 1 && std::string(argv[1]) == "rnr") {
    print_rnr_counters();
    for (int ms : {300, 500, 700})
      test_rnr_loop(rig, 4, std::chrono::milliseconds(ms));
    for (int i = 0; i < 4; ++i) test_datapath(rig);
    print_rnr_counters();
    rig.listener.reset();
    std::printf("== %d passed, %d failed\n", g_passes, g_failures);
    return g_failures == 0 ? 0 : 1;
  }

  std::printf("== private data, reject, unreachable\n");
  test_private_data(rig);
  test_reject(rig);
  test_unreachable(rig);
  std::printf("== datapath\n");
  test_datapath(rig);
  std::printf("== errors\n");
  test_bad_keys(rig);
  test_cq_capacity(rig);
  std::printf("== teardown\n");
  test_peer_death(rig);
  test_many_connections(rig);

  rig.listener.reset();
  rig.client_fabric.reset();
  rig.server_fabric.reset();
  std::printf("== %d passed, %d failed\n", g_passes, g_failures);
  return g_failures == 0 ? 0 : 1;
}
