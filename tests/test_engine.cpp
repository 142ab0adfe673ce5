// The engine check of NOTE [saved-tensor hooks in C++]: remat refuses to run
// beside another default autograd engine (as libtorch_python installs), both
// when that engine came first and when it replaced remat's later. Its own
// binary: the engine is process-wide state.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <remat/remat.h>

namespace {

struct ForeignEngine final : torch::autograd::Engine {
  ~ForeignEngine() override { stop(); }
};

torch::autograd::Engine& foreign() {
  static ForeignEngine engine;
  return engine;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const remat::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Engine, RefusesAForeignDefaultEngine) {
  auto x = torch::randn({3}, torch::requires_grad());
  auto fn = [](torch::Tensor a) { return a.exp(); };
  // Another engine first (Python's would be a PythonEngine).
  torch::autograd::set_default_engine_stub(&foreign);
  const std::string first = error_of([&] { remat::checkpoint(fn, x); });
  EXPECT_EQ(first.rfind("[remat::hooks] another autograd engine (", 0), 0u) << first;
  EXPECT_NE(first.find(") is already the default, e.g. Python's from libtorch_python; remat's saved-tensor hooks "
                       "cannot work beside it. Use remat from a C++ process without the Python bindings loaded."),
            std::string::npos)
      << first;
  // With the base engine back, remat installs its own and works.
  torch::autograd::set_default_engine_stub(&torch::autograd::Engine::get_base_engine);
  remat::checkpoint(fn, x).sum().backward();
  EXPECT_TRUE(torch::allclose(x.grad(), x.detach().exp()));
  // Replaced afterwards: refused at the next entry point.
  torch::autograd::set_default_engine_stub(&foreign);
  EXPECT_EQ(error_of([&] { remat::checkpoint(fn, x); }),
            "[remat::hooks] remat's autograd engine was replaced by another one (e.g. Python's); saved-tensor hooks "
            "would be ignored and checkpoints would keep everything. Use remat from a C++ process without the "
            "Python bindings loaded.");
}

}  // namespace
