#include "core/path_state.h"

namespace ibtrs::core {

bool transition_allowed(ClientPathState from, ClientPathState to) {
  using S = ClientPathState;
  switch (to) {
    case S::connecting:  // a new attempt after a failure or a break
      return from == S::reconnecting;
    case S::connecting_err:
      return from == S::connecting;
    case S::reconnecting:
      return from == S::connected || from == S::connecting_err || from == S::closed;
    case S::connected:
      return from == S::connecting;
    case S::closing:
      return from == S::connecting || from == S::connecting_err || from == S::reconnecting ||
             from == S::connected;
    case S::closed:
      return from == S::closing;
    case S::dead:
      return from == S::closed;
  }
  return false;
}

bool transition_allowed(ServerPathState from, ServerPathState to) {
  using S = ServerPathState;
  switch (to) {
    case S::connecting:
      return false;  // a server path starts there and never returns
    case S::connected:
      return from == S::connecting;
    case S::closing:
      return from == S::connecting || from == S::connected;
    case S::closed:
      return from == S::closing;
  }
  return false;
}

}  // namespace ibtrs::core
