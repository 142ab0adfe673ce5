// Owning pointers to autograd nodes across LibTorch versions: an Edge holds
// its node by std::shared_ptr up to LibTorch 2.12 and by c10::intrusive_ptr
// from 2.13. NodePtr<T>, make_node<T>() and node_ref() follow whichever the
// LibTorch being compiled against uses, so remat builds against both (the
// lent GPU machine has 2.11, the development machines 2.13).
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

namespace remat::detail {

/** The pointer an Edge holds its node by. */
using AnyNodePtr = std::decay_t<decltype(std::declval<torch::autograd::Edge>().function)>;
/** True where nodes are shared_ptr-owned (LibTorch <= 2.12). */
inline constexpr bool kSharedNodes = std::is_same_v<AnyNodePtr, std::shared_ptr<torch::autograd::Node>>;

/** An owning pointer to a node of type T, as this LibTorch owns nodes. */
template <class T>
using NodePtr = std::conditional_t<kSharedNodes, std::shared_ptr<T>, c10::intrusive_ptr<T>>;

/** A new node of type T (make_shared or make_intrusive). */
template <class T, class... A>
NodePtr<T> make_node(A&&... a) {
  if constexpr (kSharedNodes) {
    return std::make_shared<T>(std::forward<A>(a)...);
  } else {
    return c10::make_intrusive<T>(std::forward<A>(a)...);
  }
}

/** An owning pointer to a node the engine holds (e.g. the one it runs),
 *  from its raw pointer. */
template <class P = AnyNodePtr>  // a template, so that the branch not taken is not compiled
P node_ref(torch::autograd::Node* n) {
  if constexpr (std::is_same_v<P, std::shared_ptr<torch::autograd::Node>>) {
    return n->getptr();
  } else {
    return P::reclaim_copy(n);
  }
}

}  // namespace remat::detail
