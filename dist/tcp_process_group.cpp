// The "tcp" backend: CPU collectives over a mesh of TCP connections that the
// ranks set up through the rendezvous store. It needs nothing but the store,
// so `tessera launch` runs on CPU without mpirun.
//
// Reductions and all-gathers go through rank 0 (a star): every rank sends its
// data to rank 0, which combines them in rank order and sends the result back.
// That is simple, deadlock-free (only one side of a connection sends at a time)
// and bit-identical on every rank; its bandwidth suits CPU tests and small jobs.
// Every message carries its byte count so a size mismatch is an error, not a
// desynchronised stream.
#include <cstring>

#include "tessera/dist/host_process_group.h"

namespace tessera::dist {
namespace {

class TcpProcessGroup final : public HostProcessGroup {
 public:
  // Connects this rank to every other member; `prefix` makes the store keys unique to
  // this group. `address` is how peers reach this host.
  TcpProcessGroup(int rank, int size, ProcessGroupOptions options, std::shared_ptr<Store> store,
                  std::string address, std::string prefix)
      : HostProcessGroup(rank, size, std::move(options)),
        store_(std::move(store)),
        address_(std::move(address)),
        prefix_(std::move(prefix)),
        peers_(size) {
    connect_mesh();
  }
  ~TcpProcessGroup() override { stop_worker(); }
  std::string backend_name() const override { return "tcp"; }

 protected:
  void host_all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, Deadline d) override {
    const size_t bytes = count * dtype_size(dtype);
    if (rank() == 0) {
      std::vector<char> incoming(bytes);
      for (int r = 1; r < size(); ++r) {
        receive_message(r, incoming.data(), bytes, d);
        reduce_into(dtype, op, data, incoming.data(), count);
      }
      for (int r = 1; r < size(); ++r) send_message(r, data, bytes, d);
    } else {
      send_message(0, data, bytes, d);
      receive_message(0, data, bytes, d);
    }
  }

  void host_reduce_scatter(const void* in, void* out, int64_t count, DType dtype, ReduceOp op,
                           Deadline d) override {
    const size_t chunk = count * dtype_size(dtype);
    std::vector<char> all(chunk * size());
    std::memcpy(all.data(), in, all.size());
    host_all_reduce(all.data(), count * size(), dtype, op, d);
    std::memcpy(out, all.data() + chunk * rank(), chunk);
  }

  void host_all_gather(const void* in, const std::vector<void*>& outs,
                       const std::vector<size_t>& out_bytes, Deadline d) override {
    std::memmove(outs[rank()], in, out_bytes[rank()]);
    if (rank() == 0) {
      for (int r = 1; r < size(); ++r) receive_message(r, outs[r], out_bytes[r], d);
      for (int r = 1; r < size(); ++r)
        for (int src = 0; src < size(); ++src)
          if (src != r) send_message(r, outs[src], out_bytes[src], d);
    } else {
      send_message(0, in, out_bytes[rank()], d);
      for (int src = 0; src < size(); ++src)
        if (src != rank()) receive_message(0, outs[src], out_bytes[src], d);
    }
  }

  void host_broadcast(void* data, size_t bytes, int root, Deadline d) override {
    if (rank() == root) {
      for (int r = 0; r < size(); ++r)
        if (r != root) send_message(r, data, bytes, d);
    } else {
      receive_message(root, data, bytes, d);
    }
  }

  void host_barrier(Deadline d) override {
    char token = 1;
    host_all_reduce(&token, 1, DType::u8, ReduceOp::Max, d);
  }

  void host_send(const void* data, size_t bytes, int dst, int tag, Deadline d) override {
    send_message(dst, data, bytes, d, tag);
  }
  void host_recv(void* data, size_t bytes, int src, int tag, Deadline d) override {
    receive_message(src, data, bytes, d, tag);
  }

  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks, uint64_t group_id,
                                             ProcessGroupOptions options) override {
    std::shared_ptr<ProcessGroup> group;
    // On the worker, so the mesh set-up cannot overtake collectives already queued.
    run_on_worker("new_group", [&](Deadline) {
      auto it = std::find(ranks.begin(), ranks.end(), rank());
      if (it == ranks.end()) return;
      group = std::make_shared<TcpProcessGroup>(
          static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()), options, store_,
          address_, prefix_ + "/sub" + std::to_string(group_id));
    });
    return group;
  }

 private:
  // Header before every payload: byte count and tag (0 for collectives).
  struct Header {
    uint64_t bytes;
    int64_t tag;
  };

  void send_message(int peer, const void* data, size_t bytes, Deadline d, int tag = 0) {
    naming_peer(peer, [&] {
      Header h{bytes, tag};
      peers_[peer].send_all(&h, sizeof h, d);
      peers_[peer].send_all(data, bytes, d);
    });
  }

  void receive_message(int peer, void* data, size_t bytes, Deadline d, int tag = 0) {
    naming_peer(peer, [&] {
      Header h{};
      peers_[peer].recv_all(&h, sizeof h, d);
      TESSERA_CHECK(h.bytes == bytes && h.tag == tag, "dist(tcp): rank ", rank(), " expected ",
                    bytes, " bytes (tag ", tag, ") from rank ", peer, " but it sent ", h.bytes,
                    " bytes (tag ", h.tag, "): the ranks called different operations or sizes");
      peers_[peer].recv_all(data, bytes, d);
    });
  }

  // A lost connection is reported with the rank at its other end.
  template <class Fn>
  void naming_peer(int peer, Fn&& fn) {
    try {
      fn();
    } catch (const PeerClosedError& e) {
      throw PeerClosedError(detail::concat("lost the connection to rank ", peer, ": ", e.what()));
    }
  }

  // Rank i dials every rank below it and accepts every rank above it; each new connection
  // starts with the dialler's rank so the acceptor knows who it is.
  void connect_mesh() {
    Deadline d = Deadline::after(options().timeout_s);
    Listener listener("", 0);
    store_->set(prefix_ + "/addr/" + std::to_string(rank()),
                address_ + ":" + std::to_string(listener.port()));
    for (int r = 0; r < rank(); ++r) {
      std::string where = store_->get(prefix_ + "/addr/" + std::to_string(r));
      size_t colon = where.rfind(':');
      Socket s = Socket::connect(where.substr(0, colon), std::stoi(where.substr(colon + 1)), d,
                                 "rank " + std::to_string(r) + " of group '" + options().name + "'");
      s.send_u64(static_cast<uint64_t>(rank()), d);
      peers_[r] = std::move(s);
    }
    for (int accepted = rank() + 1; accepted < size(); ++accepted) {
      Socket s = listener.accept(d);
      uint64_t peer = s.recv_u64(d);
      TESSERA_CHECK(peer > static_cast<uint64_t>(rank()) && peer < static_cast<uint64_t>(size()) &&
                        !peers_[peer].valid(),
                    "dist(tcp): unexpected connection from rank ", peer, " in group '",
                    options().name, "'");
      peers_[peer] = std::move(s);
    }
  }

  std::shared_ptr<Store> store_;
  std::string address_;
  std::string prefix_;
  std::vector<Socket> peers_;
};

const bool registered = [] {
  register_backend("tcp", [](const BackendContext& ctx) -> std::shared_ptr<ProcessGroup> {
    TESSERA_CHECK(ctx.store, "dist: the tcp backend needs the rendezvous store");
    auto* tcp_store = dynamic_cast<TCPStore*>(ctx.store.get());
    std::string address = tcp_store ? tcp_store->local_address() : "127.0.0.1";
    // A fresh prefix per world created in this job (init/destroy/init re-uses the store
    // port but must not meet stale keys).
    std::string prefix = "tcp/world" + std::to_string(ctx.store->add("tcp/worlds/" +
                                                                     std::to_string(ctx.env.rank), 1));
    return std::make_shared<TcpProcessGroup>(ctx.env.rank, ctx.env.world_size, ctx.options,
                                             ctx.store, address, prefix);
  });
  return true;
}();

}  // namespace
}  // namespace tessera::dist
