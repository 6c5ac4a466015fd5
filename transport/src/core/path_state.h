// Path states and the one function that changes them (kernel: rtrs_clt_change_state,
// rtrs_srv_change_state). Every state change of a path goes through PathState::change(), so the
// allowed transitions below are the whole truth about the life of a path.
//
// Client path:
//   CONNECTING ---------> CONNECTED ------> RECONNECTING ----> CONNECTING (again)
//      |                      |                 ^   |
//      v                      |                 |   v
//   CONNECTING_ERR -----------+---------------> +   CLOSING --> CLOSED --> DEAD
//   (any of CONNECTING, CONNECTING_ERR, RECONNECTING, CONNECTED may go to CLOSING;
//    CLOSED may go to RECONNECTING: a "reconnect" of a disconnected path)
// Server path: CONNECTING -> CONNECTED -> CLOSING -> CLOSED; CONNECTING -> CLOSING.
//
// Thread-safety: all methods may be called from any thread; change() is atomic.
#pragma once

#include <atomic>
#include <cstdint>
#include <string_view>

#include "ibtrs/result.h"
#include "ibtrs/types.h"

namespace ibtrs::core {

using ibtrs::ClientPathState;
using ibtrs::ServerPathState;

bool transition_allowed(ClientPathState from, ClientPathState to);
bool transition_allowed(ServerPathState from, ServerPathState to);

template <typename State>
class PathState {
 public:
  explicit PathState(State initial) : state_(initial) {}

  State get() const { return state_.load(std::memory_order_acquire); }

  // Moves to `to` when allowed from the current state and returns the state it left.
  // EINVAL (state unchanged) when the transition is not allowed.
  Result<State> change(State to) {
    State cur = get();
    do {
      if (!transition_allowed(cur, to)) return errc(EINVAL);
    } while (!state_.compare_exchange_weak(cur, to, std::memory_order_acq_rel));
    return cur;
  }

  // Moves to `to` only from `expected`: EAGAIN when another change came first.
  Status change_from(State expected, State to) {
    if (!transition_allowed(expected, to)) return errc(EINVAL);
    return state_.compare_exchange_strong(expected, to, std::memory_order_acq_rel)
               ? Status{}
               : Status{errc(EAGAIN)};
  }

 private:
  std::atomic<State> state_;
};

using ClientPathStateMachine = PathState<ClientPathState>;
using ServerPathStateMachine = PathState<ServerPathState>;

}  // namespace ibtrs::core
