#include "core/path_state.h"

namespace ibtrs::core {

std::string_view to_string(ClientPathState s) {
  switch (s) {
    case ClientPathState::connecting: return "connecting";
    case ClientPathState::connecting_err: return "connecting_err";
    case ClientPathState::reconnecting: return "reconnecting";
    case ClientPathState::connected: return "connected";
    case ClientPathState::closing: return "closing";
    case ClientPathState::closed: return "closed";
    case ClientPathState::dead: return "dead";
  }
  return "?";
}

std::string_view to_string(ServerPathState s) {
  switch (s) {
    case ServerPathState::connecting: return "connecting";
    case ServerPathState::connected: return "connected";
    case ServerPathState::closing: return "closing";
    case ServerPathState::closed: return "closed";
  }
  return "?";
}

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
