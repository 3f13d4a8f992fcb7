// Helpers of the KDA layer tests (in-process and MPI): the outputs of one
// forward + backward, their relative error and their bitwise comparison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kdacp/kda_cp.hpp"
#include "kdacp/testing/synthetic.hpp"

namespace kdacp::kda::test {

template <class T>
struct LayerResult {
  std::vector<T> o, dq, dk, dv, dg, dbeta, d_incoming0;
};

template <class T>
LayerResult<T> alloc(const Shape& s) {
  LayerResult<T> r;
  r.o.resize(s.v_elems());
  r.dq.resize(s.qk_elems());
  r.dk.resize(s.qk_elems());
  r.dv.resize(s.v_elems());
  r.dg.resize(s.g_elems());
  r.dbeta.resize(s.beta_elems());
  r.d_incoming0.resize(s.state_elems());
  return r;
}

template <class T>
double rel(const std::vector<T>& a, const std::vector<T>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / den);
}

template <class T>
void expect_close(const LayerResult<T>& got, const LayerResult<T>& want, double tol, const std::string& what) {
  EXPECT_LT(rel(got.o, want.o), tol) << what << " o";
  EXPECT_LT(rel(got.dq, want.dq), tol) << what << " dq";
  EXPECT_LT(rel(got.dk, want.dk), tol) << what << " dk";
  EXPECT_LT(rel(got.dv, want.dv), tol) << what << " dv";
  EXPECT_LT(rel(got.dg, want.dg), tol) << what << " dg";
  EXPECT_LT(rel(got.dbeta, want.dbeta), tol) << what << " dbeta";
  EXPECT_LT(rel(got.d_incoming0, want.d_incoming0), tol) << what << " d_incoming";
}

template <class T>
bool same_bits(const LayerResult<T>& a, const LayerResult<T>& b) {
  auto eq = [](const std::vector<T>& x, const std::vector<T>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
  };
  return eq(a.o, b.o) && eq(a.dq, b.dq) && eq(a.dk, b.dk) && eq(a.dv, b.dv) && eq(a.dg, b.dg) &&
         eq(a.dbeta, b.dbeta);
}

}  // namespace kdacp::kda::test
