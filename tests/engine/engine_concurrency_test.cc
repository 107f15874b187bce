// Many threads on one engine with several CPU devices: steps checked against each thread's
// float64 oracle while other threads fork from a shared sequence that is being migrated back and
// forth, migrate and export their own sequences and close them. Page copies run outside the
// engine lock; nothing may be lost or leaked (also run under TSan).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/reference/step_oracle.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

ModelSpec Spec() {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kDense};
  s.index_topk = 12;
  return s;
}

using Batch = std::vector<std::pair<std::string, int64_t>>;

// Runs one step and returns the worst relative L2 against the oracle (which it then updates);
// -1 when the step failed (the test then fails on `error`).
double CheckedStep(Engine& e, reference::StepOracle& oracle, const Batch& batch,
                   const std::vector<LayerData>& layers, std::string* error) {
  std::vector<StepEntry> entries;
  int64_t T = 0;
  for (const auto& [id, q] : batch) {
    entries.push_back({id, q});
    T += q;
  }
  auto step = e.BeginStep(entries);
  if (!step.ok()) {
    *error = step.status().ToString();
    return -1;
  }
  const ModelSpec& s = e.spec();
  std::vector<std::vector<double>> got(s.num_layers());
  std::vector<std::vector<std::vector<int32_t>>> keys(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l) {
    std::vector<float> out(static_cast<size_t>(T) * s.num_heads * s.kv_lora_rank, NAN);
    LayerTrace trace;
    const absl::Status st =
        RunLayerInto(e, *step, l, layers[l].inputs(), out.data(), out.size() * 4, &trace);
    if (!st.ok()) {
      *error = st.ToString();
      return -1;
    }
    got[l].assign(out.begin(), out.end());
    keys[l] = trace.keys;
  }
  std::vector<reference::LayerValues> values;
  for (const auto& l : layers) values.push_back(l.values());
  oracle.Commit(batch, values);
  std::vector<LayerCheck> checks;
  const auto want = oracle.Expected(batch, values, &keys, &checks);
  double worst = 0;
  for (int l = 0; l < s.num_layers(); ++l) {
    for (double x : got[l])
      if (std::isnan(x)) return 1e9;
    if (checks[l].selection_mismatches != 0) return 1e9;
    worst = std::max(worst, RelL2(got[l], want[l]));
  }
  return worst;
}

TEST(EngineConcurrency, StepsForksMigrationsAndExportsAtOnceLoseNothing) {
  EngineOptions o;
  o.spec = Spec();
  o.cache_dtype = DType::kF32;
  o.num_devices = 3;
  o.pages_per_device = 400;
  o.threads = 2;
  auto engine = Engine::Create(o);
  ASSERT_TRUE(engine.ok()) << engine.status();
  Engine& e = **engine;
  const ModelSpec& s = e.spec();
  // The shared root every worker forks from.
  ASSERT_TRUE(e.OpenSequence("root", 0).ok());
  const auto root_layers = RandomLayers(s, 50, DType::kF32, 1);
  constexpr int kWorkers = 3;
  std::vector<reference::StepOracle> oracles(kWorkers, reference::StepOracle(s, DType::kF32));
  {
    reference::StepOracle first(s, DType::kF32);
    first.Open("root");
    std::string error;
    ASSERT_GE(CheckedStep(e, first, {{"root", 50}}, root_layers, &error), 0) << error;
    EXPECT_LE(CheckedStep(e, first, {{"root", 1}}, RandomLayers(s, 1, DType::kF32, 2), &error),
              1e-5)
        << error;
    for (auto& w : oracles) w = first;
  }
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::vector<std::string> errors(kWorkers + 1);
  // The root moves between devices all the time: forks and exports of it must still work.
  std::thread mover([&] {
    for (int i = 0; !stop; ++i) {
      const absl::Status m = e.MigrateSequence("root", i % 3);
      auto rows = e.ReadRows("root", i % s.num_layers(), 0, 51);
      if (!m.ok() || !rows.ok() || rows->kv_latent.size() != 51 * s.kv_lora_rank * 4u) {
        errors[kWorkers] = !m.ok() ? m.ToString() : rows.status().ToString();
        ++failures;
        return;
      }
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937_64 rng(100 + w);
      reference::StepOracle& oracle = oracles[w];
      auto fail = [&](const std::string& why) {
        errors[w] = why;
        ++failures;
      };
      for (int round = 0; round < 12 && failures == 0; ++round) {
        const std::string a = absl::StrCat("w", w, "a", round);
        const std::string b = absl::StrCat("w", w, "b", round);
        const int64_t prefix = 1 + static_cast<int64_t>(rng() % 51);
        if (absl::Status f = e.ForkSequence(a, "root", prefix, static_cast<int>(rng() % 4) - 1);
            !f.ok())
          return fail(absl::StrCat("fork: ", f.ToString()));
        oracle.Fork(a, "root", prefix);
        if (absl::Status op = e.OpenSequence(b); !op.ok())
          return fail(absl::StrCat("open: ", op.ToString()));
        oracle.Open(b);
        for (int k = 0; k < 3; ++k) {
          const Batch batch = {{a, 1 + static_cast<int64_t>(rng() % 20)},
                               {b, 1 + static_cast<int64_t>(rng() % 20)}};
          std::string error;
          const double err = CheckedStep(
              e, oracle, batch,
              RandomLayers(s, batch[0].second + batch[1].second, DType::kF32, rng()), &error);
          if (err < 0) return fail(absl::StrCat("step: ", error));
          if (err > 1e-5) return fail(absl::StrCat("step: rel L2 ", err));
          if (absl::Status m = e.MigrateSequence(a, static_cast<int>(rng() % 3)); !m.ok())
            return fail(absl::StrCat("migrate: ", m.ToString()));
          auto len = e.DescribeSequence(a);
          auto rows = e.ReadRows(a, static_cast<int>(rng() % s.num_layers()), 0, len->length);
          if (!rows.ok()) return fail(absl::StrCat("export: ", rows.status().ToString()));
        }
        for (const std::string& id : {a, b}) {
          if (absl::Status c = e.CloseSequence(id); !c.ok())
            return fail(absl::StrCat("close: ", c.ToString()));
          oracle.Close(id);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  stop = true;
  mover.join();
  for (const std::string& why : errors) EXPECT_TRUE(why.empty()) << why;
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(e.num_sequences(), 1);
  ASSERT_TRUE(e.CloseSequence("root").ok());
  for (const DeviceCapacity& c : e.Capacity()) EXPECT_EQ(c.pages_free, c.pages_total) << c.name;
  for (int d = 0; d < e.num_devices(); ++d) EXPECT_TRUE(e.ReservedPageUntouched(d));
}

}  // namespace
}  // namespace attnd::testing
