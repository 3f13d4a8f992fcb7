#include "kdacp/mesh.hpp"

#include <algorithm>
#include <numeric>
#include <set>
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kdacp/error.hpp"

namespace kdacp {

// The root layout: the communicator every group is created over, and the
// row-major arrangement of its global ranks into named dims.
struct DeviceMesh::Root {
  std::shared_ptr<Communicator> comm;
  std::vector<std::size_t> shape;
  std::vector<std::string> names;
  std::vector<std::size_t> ranks;  // row-major over shape
};

namespace {

std::size_t product(const std::vector<std::size_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::size_t{1}, std::multiplies<>());
}

std::size_t my_global(const Communicator& comm) { return comm.global_ranks().at(comm.rank()); }

std::vector<std::size_t> coords_of(const std::vector<std::size_t>& shape, std::size_t index) {
  std::vector<std::size_t> c(shape.size());
  for (std::size_t d = shape.size(); d-- > 0;) {
    c[d] = index % shape[d];
    index /= shape[d];
  }
  return c;
}

std::size_t index_of(const std::vector<std::size_t>& shape, const std::vector<std::size_t>& c) {
  std::size_t index = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + c[d];
  return index;
}

void check_names(const std::vector<std::string>& names, std::size_t want) {
  if (names.size() != want)
    throw InvalidArgument(fmt::format("mesh dim names: {} given, expected {}", names.size(), want));
  std::set<std::string> seen;
  for (const auto& n : names) {
    if (n.empty()) throw InvalidArgument("mesh dim name is empty, expected a non-empty name");
    if (!seen.insert(n).second)
      throw InvalidArgument(fmt::format("mesh dim name '{}' is duplicated, expected unique names", n));
  }
}

// Coordinates of this rank in a root layout.
std::vector<std::size_t> my_coords(const std::vector<std::size_t>& shape,
                                   const std::vector<std::size_t>& ranks, std::size_t global) {
  auto it = std::find(ranks.begin(), ranks.end(), global);
  if (it == ranks.end())
    throw InvalidArgument(fmt::format("rank {} is outside the mesh [{}]", global, fmt::join(ranks, ",")));
  return coords_of(shape, static_cast<std::size_t>(it - ranks.begin()));
}

// Group along root dim `d` through every rank: color = the other coords,
// key = the coord along d. Every rank of the root calls this.
std::shared_ptr<Communicator> make_dim_group(const std::vector<std::size_t>& shape,
                                             const std::vector<std::size_t>& coords,
                                             Communicator& comm, std::size_t d) {
  std::vector<std::size_t> other_shape, other_coords;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i == d) continue;
    other_shape.push_back(shape[i]);
    other_coords.push_back(coords[i]);
  }
  const int color = static_cast<int>(index_of(other_shape, other_coords));
  return comm.split(color, static_cast<int>(coords[d]));
}

}  // namespace

DeviceMesh DeviceMesh::create(std::shared_ptr<Communicator> world, std::vector<std::size_t> shape,
                              std::vector<std::string> names) {
  if (!world) throw InvalidArgument("mesh communicator is null");
  check_names(names, shape.size());
  if (shape.empty() || product(shape) != world->size())
    throw InvalidArgument(fmt::format("mesh shape [{}] has {} ranks, expected the {} ranks of the communicator",
                                      fmt::join(shape, ","), product(shape), world->size()));
  auto root = std::make_shared<Root>();
  root->comm = world;
  root->shape = shape;
  root->names = names;
  root->ranks = world->global_ranks();
  DeviceMesh mesh;
  mesh.root_ = root;
  mesh.shape_ = shape;
  mesh.names_ = names;
  mesh.root_dims_.resize(shape.size());
  std::iota(mesh.root_dims_.begin(), mesh.root_dims_.end(), std::size_t{0});
  mesh.ranks_ = root->ranks;
  const auto coords = my_coords(shape, root->ranks, my_global(*world));
  for (std::size_t d = 0; d < shape.size(); ++d)
    mesh.groups_.push_back(shape.size() == 1 ? world : make_dim_group(shape, coords, *world, d));
  return mesh;
}

DeviceMesh DeviceMesh::from_group(std::shared_ptr<Communicator> comm,
                                  std::vector<std::size_t> rank_list, std::string name) {
  if (!comm) throw InvalidArgument("mesh communicator is null");
  check_names({name}, 1);
  if (rank_list.size() != comm->size())
    throw InvalidArgument(fmt::format("mesh rank list [{}] has {} ranks, expected the {} ranks of its communicator",
                                      fmt::join(rank_list, ","), rank_list.size(), comm->size()));
  std::set<std::size_t> seen;
  for (std::size_t r : rank_list)
    if (!seen.insert(r).second)
      throw InvalidArgument(fmt::format("mesh rank list [{}] repeats rank {}, expected unique global ranks",
                                        fmt::join(rank_list, ","), r));
  auto root = std::make_shared<Root>();
  root->comm = comm;
  root->shape = {rank_list.size()};
  root->names = {name};
  root->ranks = rank_list;
  my_coords(root->shape, rank_list, my_global(*comm));
  DeviceMesh mesh;
  mesh.root_ = root;
  mesh.shape_ = root->shape;
  mesh.names_ = root->names;
  mesh.root_dims_ = {0};
  mesh.ranks_ = rank_list;
  mesh.groups_ = {comm};
  return mesh;
}

std::size_t DeviceMesh::size() const { return product(shape_); }

std::size_t DeviceMesh::global_rank() const { return my_global(*root_->comm); }

std::size_t DeviceMesh::local_rank(std::size_t dim) const {
  const auto coords = my_coords(root_->shape, root_->ranks, global_rank());
  return coords.at(root_dims_.at(dim));
}

std::shared_ptr<Communicator> DeviceMesh::group(std::size_t dim) const { return groups_.at(dim); }

std::size_t DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  if (it == names_.end()) {
    throw InvalidArgument(
        fmt::format("mesh has no dim named '{}', expected one of: {}", name, fmt::join(names_, ", ")));
  }
  return static_cast<std::size_t>(it - names_.begin());
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  const std::size_t d = dim_index(name);
  const std::size_t rd = root_dims_[d];
  auto coords = my_coords(root_->shape, root_->ranks, global_rank());
  DeviceMesh sub;
  sub.root_ = root_;
  sub.root_dims_ = {rd};
  sub.shape_ = {shape_[d]};
  sub.names_ = {names_[d]};
  for (std::size_t i = 0; i < root_->shape[rd]; ++i) {
    coords[rd] = i;
    sub.ranks_.push_back(root_->ranks[index_of(root_->shape, coords)]);
  }
  sub.groups_ = {groups_[d]};
  return sub;
}

DeviceMesh DeviceMesh::unflatten(std::size_t dim, const std::vector<std::size_t>& sizes,
                                 const std::vector<std::string>& names) const {
  if (dim >= ndim())
    throw InvalidArgument(fmt::format("unflatten dim {}, expected < {}", dim, ndim()));
  if (sizes.empty() || product(sizes) != shape_[dim])
    throw InvalidArgument(fmt::format("unflatten sizes [{}] multiply to {}, expected the size {} of dim '{}'",
                                      fmt::join(sizes, ","), product(sizes), shape_[dim], names_[dim]));
  check_names(names, sizes.size());
  const std::size_t rd = root_dims_[dim];
  auto root = std::make_shared<Root>();
  root->comm = root_->comm;
  root->ranks = root_->ranks;
  for (std::size_t i = 0; i < root_->shape.size(); ++i) {
    if (i == rd) {
      root->shape.insert(root->shape.end(), sizes.begin(), sizes.end());
      root->names.insert(root->names.end(), names.begin(), names.end());
    } else {
      root->shape.push_back(root_->shape[i]);
      root->names.push_back(root_->names[i]);
    }
  }
  check_names(root->names, root->shape.size());

  DeviceMesh out;
  out.root_ = root;
  const std::size_t extra = sizes.size() - 1;
  const auto coords = my_coords(root->shape, root->ranks, global_rank());
  for (std::size_t d = 0; d < ndim(); ++d) {
    const std::size_t old_rd = root_dims_[d];
    if (d == dim) {
      for (std::size_t j = 0; j < sizes.size(); ++j) {
        out.root_dims_.push_back(rd + j);
        out.shape_.push_back(sizes[j]);
        out.names_.push_back(names[j]);
        // Every rank of the root takes part, so sibling replicas get theirs.
        out.groups_.push_back(make_dim_group(root->shape, coords, *root->comm, rd + j));
      }
    } else {
      out.root_dims_.push_back(old_rd > rd ? old_rd + extra : old_rd);
      out.shape_.push_back(shape_[d]);
      out.names_.push_back(names_[d]);
      out.groups_.push_back(groups_[d]);
    }
  }
  // This mesh's ranks: vary its dims, fix the others at this rank's coords.
  const std::size_t n = out.size();
  for (std::size_t i = 0; i < n; ++i) {
    auto c = coords;
    auto local = coords_of(out.shape_, i);
    for (std::size_t d = 0; d < out.root_dims_.size(); ++d) c[out.root_dims_[d]] = local[d];
    out.ranks_.push_back(root->ranks[index_of(root->shape, c)]);
  }
  return out;
}

std::size_t DeviceMesh::root_size() const { return root_->ranks.size(); }
std::size_t DeviceMesh::world_size() const { return root_->comm->world_size(); }

void DeviceMesh::validate_order() const {
  if (ndim() != 1)
    throw InvalidArgument(fmt::format("mesh order check needs a 1-D mesh, got {} dims", ndim()));
  const auto& comm_ranks = groups_[0]->global_ranks();
  if (comm_ranks != ranks_)
    throw InvalidArgument(fmt::format("rank {}: mesh rank list [{}] differs from its communicator's order [{}], "
                                      "expected the same ranks in the same (chronological) order",
                                      global_rank(), fmt::join(ranks_, ","), fmt::join(comm_ranks, ",")));
}

DeviceMesh split_mesh(const DeviceMesh& mesh, std::size_t degree, const std::string& outer,
                      const std::string& inner) {
  if (mesh.ndim() != 1)
    throw InvalidArgument(fmt::format("mesh split needs a 1-D mesh, got {} dims", mesh.ndim()));
  if (degree < 1 || mesh.size() % degree != 0)
    throw InvalidArgument(
        fmt::format("mesh split degree {}, expected a positive divisor of the mesh size {}", degree, mesh.size()));
  mesh.validate_order();
  if (mesh.root_size() != mesh.world_size())
    throw InvalidArgument(fmt::format("rank {}: mesh is detached: its root spans {} ranks, expected the whole world "
                                      "of {} (sibling groups must be created over the world)",
                                      mesh.global_rank(), mesh.root_size(), mesh.world_size()));
  return mesh.unflatten(0, {mesh.size() / degree, degree}, {outer, inner});
}

}  // namespace kdacp
