#include "sysfs/node.h"

#include <algorithm>

namespace sysfs {

std::shared_ptr<Node> Node::dir() { return std::shared_ptr<Node>(new Node()); }

std::shared_ptr<Node> Node::attr(uint32_t mode, ReadFn read, WriteFn write) {
  auto n = std::shared_ptr<Node>(new Node());
  n->kind_ = Kind::attr;
  n->mode_ = mode;
  n->read_ = std::move(read);
  n->write_ = std::move(write);
  return n;
}

std::shared_ptr<Node> Node::dynamic_dir(ListFn list, MakeFn make) {
  auto n = std::shared_ptr<Node>(new Node());
  n->list_ = std::move(list);
  n->make_ = std::move(make);
  return n;
}

Node& Node::add(const std::string& name, NodePtr child) {
  children_[name] = std::move(child);
  return *this;
}

Result<std::vector<std::string>> Node::list() const {
  if (kind_ != Kind::dir) return errc(ENOTDIR);
  if (list_) return list_();
  std::vector<std::string> out;
  out.reserve(children_.size());
  for (auto& [n, c] : children_) out.push_back(n);
  return out;
}

Result<NodePtr> Node::child(std::string_view name) const {
  if (kind_ != Kind::dir) return errc(ENOTDIR);
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string_view::npos)
    return errc(ENOENT);
  if (make_) {
    // Only listed names exist: a lookup must not conjure a session or path the daemon lacks.
    auto names = list_();
    if (!names) return names.error();
    if (std::find(names->begin(), names->end(), name) == names->end()) return errc(ENOENT);
    return make_(std::string(name));
  }
  auto it = children_.find(name);
  if (it == children_.end()) return errc(ENOENT);
  return it->second;
}

Result<std::string> Node::read() const {
  if (kind_ != Kind::attr) return errc(EISDIR);
  if (!read_) return errc(EACCES);
  return read_();
}

Status Node::write(std::string_view data) const {
  if (kind_ != Kind::attr) return errc(EISDIR);
  if (!write_) return errc(EACCES);
  return write_(data);
}

Result<NodePtr> resolve(const NodePtr& root, std::string_view path) {
  NodePtr n = root;
  while (!path.empty()) {
    const size_t slash = path.find('/');
    const std::string_view part = path.substr(0, slash);
    path = slash == std::string_view::npos ? std::string_view{} : path.substr(slash + 1);
    if (part.empty() || part == ".") continue;
    auto c = n->child(part);
    if (!c) return c.error();
    n = std::move(*c);
  }
  return n;
}

}  // namespace sysfs
