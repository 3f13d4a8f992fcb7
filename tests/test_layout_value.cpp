// The layout value (kdacp/layout.hpp): part owners, token ranges, cuts and
// names, each rule's one definition.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kdacp/error.hpp"
#include "kdacp/layout.hpp"

namespace kdacp {
namespace {

TEST(LayoutValue, PartOwnersAreExplicitAndValidated) {
  const PartOwners one = PartOwners::one_per_rank(3);
  EXPECT_EQ(one.list(), (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_TRUE(one.is_one_per_rank());
  EXPECT_EQ(one.max_per_rank(), 1u);
  const PartOwners zig = PartOwners::zigzag(3);
  EXPECT_EQ(zig.list(), (std::vector<std::size_t>{0, 1, 2, 2, 1, 0}));
  EXPECT_FALSE(zig.is_one_per_rank());
  EXPECT_EQ(zig.max_per_rank(), 2u);
  EXPECT_EQ(zig.parts_of(1), (std::vector<std::size_t>{1, 4}));
  EXPECT_EQ(zig.str(), "{0, 1, 2, 2, 1, 0}");
  // Out of rank order is a layout too, not one part per rank.
  EXPECT_FALSE(PartOwners(2, {1, 0}).is_one_per_rank());
  EXPECT_THROW(PartOwners(3, {0, 1}), InvalidArgument);     // rank 2 holds nothing
  EXPECT_THROW(PartOwners(2, {0, 1, 2}), InvalidArgument);  // rank 2 of P = 2
}

TEST(LayoutValue, ConstructorsTileTheStream) {
  const Layout even = Layout::contiguous(10, 3);  // 4, 3, 3
  EXPECT_EQ(even.part_lengths(), (std::vector<std::size_t>{4, 3, 3}));
  EXPECT_TRUE(even.owners().is_one_per_rank());
  EXPECT_EQ(even.str(), "contiguous");
  const std::vector<std::size_t> counts{1, 7, 2};
  const Layout uneven = Layout::uneven(10, 3, counts);
  EXPECT_EQ(uneven.part_lengths(), counts);
  EXPECT_EQ(uneven.local_tokens(1), 7u);
  EXPECT_EQ(uneven.str(), "uneven {1, 7, 2}");
  EXPECT_THROW(Layout::uneven(11, 3, counts), InvalidArgument);
  const Layout zig = Layout::zigzag(10, 2);  // parts of 3, 3, 2, 2
  EXPECT_TRUE(zig.owners() == PartOwners::zigzag(2));
  EXPECT_EQ(zig.part_lengths(), (std::vector<std::size_t>{3, 3, 2, 2}));
  EXPECT_EQ(zig.local_tokens(0), 5u);
  const std::vector<Part> local = zig.local_parts(0);
  ASSERT_EQ(local.size(), 2u);
  EXPECT_EQ(local[1].begin, 8u);
  EXPECT_EQ(local[1].local_begin, 3u);
  EXPECT_EQ(zig.str(), "zigzag");
  EXPECT_THROW(Layout::zigzag(3, 2), InvalidArgument);
  const Layout other(2, {{1, 0, 4}, {0, 4, 6}});
  EXPECT_EQ(other.str(), "[0,4)@1 [4,6)@0");
}

TEST(LayoutValue, CutsFollowTheSequenceStarts) {
  const Layout zig = Layout::zigzag(12, 2);  // parts [0,3) [3,6) [6,9) [9,12)
  const std::vector<std::int64_t> cu{0, 5, 9, 12};
  EXPECT_EQ(zig.cuts(Sequences(1, 12, cu)), (std::vector<bool>{true, true, false, true}));  // 9 starts part 3
  const std::vector<std::int64_t> two{0, 7, 12};
  EXPECT_EQ(zig.cuts(Sequences(1, 12, two)), (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(zig.cuts(Sequences(2, 12)), (std::vector<bool>{true, false, false, false}));
  EXPECT_THROW(zig.cuts(Sequences(1, 11)), InvalidArgument);
}

}  // namespace
}  // namespace kdacp
