// Device mesh (SPEC §7): an n-D arrangement of global ranks with named dims.
//
// Every mesh remembers its root: the mesh built from the world communicator.
// A 1-D sub-mesh (for example the CP axis of a (cp, dp) mesh) lists its
// global ranks in chronological order, and its communicator lists the same
// ranks in the same order. unflatten() splits one dim into several; the new
// groups are created over the root communicator by EVERY rank of the root, so
// sibling replicas (the other dp copies) get their groups too.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "kdacp/comm.hpp"

namespace kdacp {

class DeviceMesh {
 public:
  // Collective over `world`: arranges ranks 0..N-1 row-major into `shape`
  // (product must equal world->size()) and creates one group per dim.
  static DeviceMesh create(std::shared_ptr<Communicator> world, std::vector<std::size_t> shape,
                           std::vector<std::string> names);

  // A 1-D mesh over an existing group communicator with an explicit
  // chronological rank list (global ranks). Checks duplicates; the match with
  // the communicator's order is checked where it matters (validate_order).
  // The result has no root spanning the world unless `comm` is the world.
  static DeviceMesh from_group(std::shared_ptr<Communicator> comm,
                               std::vector<std::size_t> rank_list, std::string name);

  std::size_t ndim() const { return names_.size(); }
  std::size_t size() const;  // product of the shape
  std::size_t size(std::size_t dim) const { return shape_.at(dim); }
  const std::vector<std::size_t>& shape() const { return shape_; }
  const std::vector<std::string>& names() const { return names_; }
  // Global ranks of this mesh, row-major over its dims. For a 1-D mesh: the
  // chronological order.
  const std::vector<std::size_t>& rank_list() const { return ranks_; }
  std::size_t global_rank() const;
  // Coordinate of this rank along `dim` (1-D: its chronological position).
  std::size_t local_rank(std::size_t dim = 0) const;
  // Communicator of the group along `dim` through this rank.
  std::shared_ptr<Communicator> group(std::size_t dim = 0) const;
  std::size_t dim_index(const std::string& name) const;

  // 1-D sub-mesh along the dim called `name`, through this rank.
  DeviceMesh operator[](const std::string& name) const;

  // Replaces `dim` by len(sizes) dims named `names` (product must match).
  // Collective over the ROOT communicator: every rank of the root calls it.
  DeviceMesh unflatten(std::size_t dim, const std::vector<std::size_t>& sizes,
                       const std::vector<std::string>& names) const;

  // Size of the root mesh (the whole world when attached).
  std::size_t root_size() const;
  std::size_t world_size() const;
  // Throws InvalidArgument unless the 1-D mesh's rank list equals its group's
  // global ranks in order (otherwise gather slots would be mistaken for
  // chronological positions).
  void validate_order() const;

 private:
  struct Root;
  DeviceMesh() = default;

  std::shared_ptr<const Root> root_;
  // Position of each of this mesh's dims among the root layout's dims.
  std::vector<std::size_t> root_dims_;
  std::vector<std::size_t> shape_;
  std::vector<std::string> names_;
  std::vector<std::size_t> ranks_;
  std::vector<std::shared_ptr<Communicator>> groups_;
};

// SPEC §7 split for the grouped protocol: 1-D mesh, integer degree dividing
// its size, root spanning the world. Returns the 2-D (outer, inner) mesh.
DeviceMesh split_mesh(const DeviceMesh& mesh, std::size_t degree, const std::string& outer,
                      const std::string& inner);

}  // namespace kdacp
