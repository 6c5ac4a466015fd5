// The JSON command codec of the daemons' control socket (socket.h), written once for both ends:
// the daemons' command handlers build their answers with it, the CLI and sysfs-emu read them.
//
//   request:  {"cmd": NAME, ...arguments}
//   answer:   {"ok": true, ...} or {"ok": false, "errno": N, "error": "text"}
//   listing:  {"ok": true, "columns": [{"name", "right"}...], "rows": [[cell...]...]}, a cell a
//             string, a number, a list of strings or {"bytes": N} (a byte count the CLI renders
//             in the unit asked for)
//
// A handler throws nothing out: a malformed request (a missing argument, a JSON value of the
// wrong type) is caught at its edge and answered EINVAL with the exception's text.
#pragma once

#include <cstdint>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "control/output.h"
#include "ibnbd/types.h"

namespace ibnbd::control {

// {"ok": false, "errno": err, "error": text, or strerror(err) when text is empty}.
nlohmann::json error(int err, const std::string& text = {});
// The same for `ec`, the text "what: <ec's message>".
nlohmann::json error(std::error_code ec, const std::string& what);
// {"ok": true}, or error(st's error, what) when it failed.
nlohmann::json answer(const Status& st, const std::string& what);

// The string argument `key` of a request; throws std::invalid_argument("missing \"key\"") when it
// is absent or not a string (the handler's edge answers EINVAL with that text).
std::string string_arg(const nlohmann::json& req, const char* key);

// A listing's column and byte-count cell, as the daemon writes them.
nlohmann::json column(const char* name, bool right = false);
nlohmann::json bytes_cell(uint64_t v);
// A listing answer as the CLI renders it. Cells beyond the columns are dropped; a cell of
// another JSON type is shown as its JSON text.
Listing listing_from_json(const nlohmann::json& rsp);

}  // namespace ibnbd::control
