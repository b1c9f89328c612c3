// The collective layer on real processes: 2, 3 and 4 ranks, fp32 / bf16 /
// fp16, lengths that do and do not divide by the group size.
//
// Inputs are small integers, so sums are exact in every dtype and results
// are compared exactly; averages are compared with the dtype's rounding.

#include <colossalai/cluster/process_group_mesh.h>
#include <colossalai/distributed/collectives.h>
#include <colossalai/distributed/error.h>
#include <colossalai/utils/compat.h>

#include <harness/multiprocess.h>
#include <harness/test_util.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include <sys/statvfs.h>
#include <unistd.h>

namespace cd = colossalai::distributed;
using colossalai::testing::run_distributed;

namespace {

const std::vector<at::ScalarType> kDtypes = {
    at::kFloat,
    at::kBFloat16,
    at::kHalf};
const std::vector<int64_t> kLengths = {1, 7, 1000, 1023};

// Rank r's deterministic input: integers in [-8, 8].
at::Tensor input(int rank, int64_t n, at::ScalarType dtype, int salt = 0) {
  auto i = at::arange(n, at::kLong);
  return ((i * 7 + rank * 13 + salt) % 17 - 8).to(dtype);
}

void expect_equal(
    const at::Tensor& got,
    const at::Tensor& want,
    const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got.to(at::kFloat), want.to(at::kFloat)))
      << what << ": max diff "
      << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<float>();
}

void check_all(int rank, int world) {
  auto group = cd::world_group();
  ASSERT_EQ(group->size(), world);
  ASSERT_EQ(group->rank(), rank);
  for (auto dtype : kDtypes) {
    for (int64_t n : kLengths) {
      std::string tag = std::string(c10::toString(dtype)) +
          " n=" + std::to_string(n) + " world=" + std::to_string(world);
      auto sum = at::zeros({n}, at::kFloat);
      auto max = at::full({n}, -100.0, at::kFloat);
      for (int r = 0; r < world; ++r) {
        sum += input(r, n, at::kFloat);
        max = at::maximum(max, input(r, n, at::kFloat));
      }

      // all_reduce sum / max / avg, in place.
      auto t = input(rank, n, dtype);
      cd::all_reduce(t, *group).wait();
      expect_equal(t, sum, "all_reduce sum " + tag);
      t = input(rank, n, dtype);
      cd::all_reduce(t, *group, cd::ReduceOp::kMax).wait();
      expect_equal(t, max, "all_reduce max " + tag);
      t = input(rank, n, dtype);
      cd::all_reduce(t, *group, cd::ReduceOp::kAvg).wait();
      double tol = dtype == at::kFloat ? 1e-6 : 1e-2 * 8;
      EXPECT_TRUE(at::allclose(t.to(at::kFloat), sum / world, 0, tol))
          << "all_reduce avg " << tag;

      // broadcast from the last rank.
      t = input(rank, n, dtype);
      cd::broadcast(t, world - 1, *group).wait();
      expect_equal(t, input(world - 1, n, dtype), "broadcast " + tag);

      // all_gather into one flat tensor (uneven shards when n % world).
      auto full = input(0, n, dtype, 5);
      auto range = cd::shard_range(n, world, rank);
      auto shard = full.slice(0, range.first, range.second).contiguous();
      auto gathered = at::empty({n}, dtype);
      cd::all_gather(gathered, shard, *group).wait();
      expect_equal(gathered, full, "all_gather " + tag);

      // reduce_scatter from one flat tensor.
      auto out = at::empty({range.second - range.first}, dtype);
      cd::reduce_scatter(out, input(rank, n, dtype), *group).wait();
      expect_equal(
          out,
          sum.slice(0, range.first, range.second),
          "reduce_scatter " + tag);
    }
  }
}

} // namespace

TEST(Collectives, TwoRanks) {
  run_distributed(2, check_all);
}

TEST(Collectives, ThreeRanks) {
  run_distributed(3, check_all);
}

TEST(Collectives, FourRanks) {
  run_distributed(4, check_all);
}

// The same over Gloo's sockets alone: its replacements for what Gloo lacks
// (NOTE [Gloo replacements]) stay covered where shared memory is the default.
TEST(Collectives, TwoAndThreeRanksOverGlooAlone) {
  colossalai::testing::MultiProcessOptions o;
  o.shm_collectives = false;
  run_distributed(2, check_all, o);
  run_distributed(3, check_all, o);
}

namespace {

// Without memfd_create groups stay on Gloo (and say so).
bool shm_usable() {
  return colossalai::testing::anonymous_shared_memory();
}

// The segment is an anonymous memory file (NOTE [Segments that cannot
// outlive their job]).
bool maps_shared_segment() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:colossalai.shm") != std::string::npos) {
      return true;
    }
  }
  return false;
}

} // namespace

// NOTE [Shared-memory collectives]: operations many slots long (2 MiB a
// slot; broadcast too), several in flight at once, uneven shards, outputs that
// alias their inputs, 16-bit and integer dtypes. Integer-valued inputs make
// every sum exact, so results are compared exactly; a sum of random floats must
// have the same bits on every rank. The segment is mapped, and has no name in
// /dev/shm.
TEST(Collectives, SharedMemoryLargeOperationsInFlight) {
  if (!shm_usable()) {
    GTEST_SKIP() << "no memfd_create here";
  }
  for (int world : {2, 3}) {
    run_distributed(world, [](int rank, int world) {
      auto group = cd::world_group();
      EXPECT_TRUE(maps_shared_segment());
      for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
        EXPECT_EQ(
            e.path().filename().string().rfind("colossalai.", 0),
            std::string::npos)
            << "left in /dev/shm: " << e.path();
      }
      EXPECT_EQ(
          cd::reduce_scatter_workspace_bytes(1 << 20, at::kFloat, *group), 0);
      const int64_t n = (int64_t(13) << 20) / 4 + world - 1; // 13 MB fp32
      auto values = [n](int r, int k, at::ScalarType dtype) {
        return at::randint(
                   -8,
                   9,
                   {n},
                   at::detail::createCPUGenerator(100 * k + r),
                   at::TensorOptions().dtype(at::kDouble))
            .to(dtype);
      };
      auto sum_of = [&](int k) {
        auto s = values(0, k, at::kDouble);
        for (int r = 1; r < world; ++r) {
          s += values(r, k, at::kDouble);
        }
        return s;
      };
      const auto range = cd::shard_range(n, world, rank);
      const int64_t len = range.second - range.first;
      for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
        const std::string tag = c10::toString(dtype);
        // In flight together: an all-reduce, a reduce-scatter whose output
        // is this rank's shard of its own input, and an all-gather whose
        // input is this rank's shard of its own output.
        auto reduced = values(rank, 0, dtype);
        auto scattered = values(rank, 1, dtype);
        auto scattered_out = scattered.narrow(0, range.first, len);
        auto gathered = at::zeros({n}, dtype);
        auto gathered_in = gathered.narrow(0, range.first, len);
        gathered_in.copy_(values(0, 2, dtype).narrow(0, range.first, len));
        auto w0 = cd::all_reduce(reduced, *group);
        auto w1 = cd::reduce_scatter(scattered_out, scattered, *group);
        auto w2 = cd::all_gather(gathered, gathered_in, *group);
        w2.wait();
        w0.wait();
        w1.wait();
        expect_equal(reduced, sum_of(0), "all_reduce " + tag);
        expect_equal(
            scattered_out,
            sum_of(1).narrow(0, range.first, len),
            "reduce_scatter " + tag);
        expect_equal(gathered, values(0, 2, dtype), "all_gather " + tag);
      }
      // A multi-slot broadcast from the last rank. (In int64, here and in
      // the loop above, the operations pass 16 MiB: all-gather and
      // broadcast stream their results out of the segment, NOTE
      // [Streaming copies out of the segment].)
      auto bc = values(rank, 5, at::kLong);
      cd::broadcast(bc, world - 1, *group).wait();
      expect_equal(bc, values(world - 1, 5, at::kLong), "broadcast");
      // Max of a multi-slot bf16 tensor, average of an fp32 one.
      auto mx = values(rank, 3, at::kBFloat16);
      cd::all_reduce(mx, *group, cd::ReduceOp::kMax).wait();
      auto want = values(0, 3, at::kDouble);
      for (int r = 1; r < world; ++r) {
        want = at::maximum(want, values(r, 3, at::kDouble));
      }
      expect_equal(mx, want, "all_reduce max bf16");
      auto avg = values(rank, 4, at::kFloat);
      cd::all_reduce(avg, *group, cd::ReduceOp::kAvg).wait();
      EXPECT_TRUE(
          at::allclose(avg.to(at::kDouble), sum_of(4) / world, 0, 1e-6));
      // Random floats: one rank sums each part, so replicas agree bit for bit.
      auto x = at::randn({n}, at::detail::createCPUGenerator(7 + rank));
      cd::all_reduce(x, *group).wait();
      auto all = at::empty({n * world});
      cd::all_gather(all, x, *group).wait();
      for (int r = 1; r < world; ++r) {
        EXPECT_TRUE(at::equal(all.narrow(0, 0, n), all.narrow(0, r * n, n)))
            << "rank " << r << "'s all_reduce result differs from rank 0's";
      }
    });
  }
}

// A rank that dies, or never comes, ends a shared-memory collective with a
// DistributedError that names the waiting rank: death is seen within a
// second or so (the dead process is polled), absence at the group timeout.
TEST(Collectives, SharedMemoryPeerThatDiesOrNeverComes) {
  if (!shm_usable()) {
    GTEST_SKIP() << "no memfd_create here";
  }
  colossalai::testing::MultiProcessOptions o;
  o.final_barrier = false;
  o.collective_timeout_seconds = 3;
  auto dies = colossalai::testing::run_processes(
      2,
      [](int rank, int) {
        auto group = cd::world_group();
        auto t = at::ones({int64_t(3) << 20});
        cd::all_reduce(t, *group).wait(); // both alive
        if (rank == 1) {
          std::_Exit(3);
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          cd::all_reduce(t, *group).wait();
          ADD_FAILURE() << "all_reduce completed without its peer";
        } catch (const cd::DistributedError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
          EXPECT_NE(msg.find("exited"), std::string::npos) << msg;
          EXPECT_LT(
              std::chrono::steady_clock::now() - start,
              std::chrono::milliseconds(2500))
              << msg;
        }
        // The channel stays broken: the next call fails at once.
        EXPECT_THROW(cd::all_reduce(t, *group).wait(), cd::DistributedError);
      },
      o);
  if (!dies.empty()) {
    ASSERT_EQ(dies.size(), 2u);
    EXPECT_EQ(dies[1].exit_code, 3);
    EXPECT_EQ(dies[0].exit_code, 0) << dies[0].output;
  }
  // Rank 1 stays alive, away from the collective, until rank 0 has given
  // up on it (a file rank 0 creates; the ranks share their parent).
  auto late = colossalai::testing::run_processes(
      2,
      [](int rank, int) {
        auto group = cd::world_group();
        auto t = at::ones({1000});
        const std::string gave_up = "/tmp/colossalai-test-late." +
            std::to_string(colossalai::testing::test_process());
        if (rank == 1) {
          const auto deadline =
              std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (!std::filesystem::exists(gave_up) &&
                 std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          EXPECT_TRUE(std::filesystem::exists(gave_up));
          std::filesystem::remove(gave_up);
          return;
        }
        try {
          cd::all_reduce(t, *group).wait();
          ADD_FAILURE() << "all_reduce completed without its peer";
        } catch (const cd::DistributedError& e) {
          const std::string msg = e.what();
          EXPECT_NE(
              msg.find("waited 3000 ms for group rank 1"), std::string::npos)
              << msg;
        }
        std::ofstream(gave_up) << "gave up\n";
      },
      o);
  if (!late.empty()) {
    ASSERT_EQ(late.size(), 2u);
    EXPECT_EQ(late[0].exit_code, 0) << late[0].output;
    EXPECT_EQ(late[1].exit_code, 0) << late[1].output;
  }
}

// Large reduce-scatters go point to point in chunks (NOTE [Gloo
// reduce-scatter]): uneven shards of several chunks each, every op, and
// two calls in flight at once (their chunks share tags and must still pair
// up in call order). Integer-valued inputs keep every sum exact.
TEST(Collectives, ChunkedReduceScatterInFlight) {
  colossalai::testing::MultiProcessOptions gloo_alone;
  gloo_alone.shm_collectives = false;
  for (int world : {2, 3}) {
    run_distributed(
        world,
        [](int rank, int world) {
          auto group = cd::world_group();
          const int64_t n =
              world * (int64_t(5) << 17) + 1; // 2.5 MB fp32 shards
          // Rank r's call-k input: integers in [-8, 8], the same on every rank.
          auto values = [n](int r, int k) {
            return at::randint(
                -8,
                9,
                {n},
                at::detail::createCPUGenerator(100 * k + r),
                at::TensorOptions().dtype(at::kDouble));
          };
          for (auto dtype : {at::kFloat, at::kDouble}) {
            for (auto op :
                 {cd::ReduceOp::kSum, cd::ReduceOp::kAvg, cd::ReduceOp::kMax}) {
              const std::string tag = std::string(c10::toString(dtype)) +
                  " op " + std::to_string(static_cast<int>(op)) + " world " +
                  std::to_string(world);
              std::vector<at::Tensor> want(2);
              for (int k = 0; k < 2; ++k) {
                for (int r = 0; r < world; ++r) {
                  auto v = values(r, k);
                  want[k] = r == 0               ? v
                      : op == cd::ReduceOp::kMax ? at::maximum(want[k], v)
                                                 : want[k] + v;
                }
                if (op == cd::ReduceOp::kAvg) {
                  want[k] /= world;
                }
              }
              const auto range = cd::shard_range(n, world, rank);
              const int64_t len = range.second - range.first;
              auto out = at::empty({len}, dtype),
                   out2 = at::empty({len}, dtype);
              auto in = values(rank, 0).to(dtype),
                   in2 = values(rank, 1).to(dtype);
              auto w = cd::reduce_scatter(out, in, *group, op);
              auto w2 = cd::reduce_scatter(out2, in2, *group, op);
              w.wait();
              w2.wait();
              const auto slice = [&](int k) {
                return want[k].slice(0, range.first, range.second);
              };
              // Exact but for the average's division (one rounding).
              EXPECT_TRUE(at::allclose(out.to(at::kDouble), slice(0), 0, 1e-6))
                  << "first call, " << tag;
              EXPECT_TRUE(at::allclose(out2.to(at::kDouble), slice(1), 0, 1e-6))
                  << "second call, " << tag;
            }
          }
        },
        gloo_alone);
  }
}

TEST(Collectives, AllToAllSendRecvBarrier) {
  for (int world : {2, 3, 4}) {
    run_distributed(world, [](int rank, int world) {
      auto group = cd::world_group();
      for (auto dtype : kDtypes) {
        // Equal blocks: block j of rank r holds 10*r + j (exact in bf16).
        const int64_t b = 5;
        auto in = at::empty({world * b}, at::kFloat);
        for (int j = 0; j < world; ++j) {
          in.slice(0, j * b, (j + 1) * b).fill_(10 * rank + j);
        }
        auto out = at::empty({world * b}, dtype);
        cd::all_to_all(out, in.to(dtype), *group).wait();
        for (int j = 0; j < world; ++j) {
          EXPECT_TRUE(out.slice(0, j * b, (j + 1) * b)
                          .to(at::kFloat)
                          .eq(10 * j + rank)
                          .all()
                          .item<bool>())
              << "all_to_all " << c10::toString(dtype) << " block " << j;
        }
        // Uneven splits: rank r sends (j + 1) elements to rank j.
        std::vector<int64_t> in_splits(world), out_splits(world, rank + 1);
        int64_t total = 0;
        for (int j = 0; j < world; ++j) {
          in_splits[j] = j + 1;
          total += j + 1;
        }
        auto uin = at::full({total}, static_cast<double>(rank), dtype);
        auto uout = at::empty({world * (rank + 1)}, dtype);
        cd::all_to_all(uout, uin, *group, out_splits, in_splits).wait();
        for (int j = 0; j < world; ++j) {
          EXPECT_TRUE(uout.slice(0, j * (rank + 1), (j + 1) * (rank + 1))
                          .to(at::kFloat)
                          .eq(j)
                          .all()
                          .item<bool>())
              << "uneven all_to_all " << c10::toString(dtype);
        }
        // Ring send/recv.
        auto msg = at::full({3}, static_cast<double>(rank), dtype);
        auto got = at::empty({3}, dtype);
        int next = (rank + 1) % world, prev = (rank + world - 1) % world;
        auto s = cd::send(msg, next, *group, 7);
        cd::recv(got, prev, *group, 7).wait();
        s.wait();
        EXPECT_TRUE(got.to(at::kFloat).eq(prev).all().item<bool>());
      }
      cd::barrier(*group).wait();
    });
  }
}

TEST(Collectives, AsyncHandlesOverlap) {
  run_distributed(2, [](int rank, int) {
    auto group = cd::world_group();
    // Several operations in flight at once, waited in issue order.
    std::vector<at::Tensor> ts;
    std::vector<cd::Work> works;
    for (int i = 0; i < 8; ++i) {
      ts.push_back(at::full(
          {4096},
          static_cast<double>(rank + i),
          i % 2 ? at::kBFloat16 : at::kFloat));
      works.push_back(cd::all_reduce(ts.back(), *group));
    }
    for (int i = 0; i < 8; ++i) {
      works[i].wait();
      EXPECT_TRUE(ts[i].to(at::kFloat).eq(1 + 2 * i).all().item<bool>());
    }
  });
}

// gather moves every rank's piece to one root only (what streamed saves
// use), in rank order, for float and bf16; a moved Work finishes once.
TEST(Collectives, GatherToOneRoot) {
  run_distributed(3, [](int rank, int world) {
    auto group = cd::world_group();
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      auto piece = at::full({5}, static_cast<double>(rank + 1), dtype);
      at::Tensor out;
      if (rank == 1) {
        out = at::empty({5 * world}, piece.options());
      }
      cd::Work w = cd::gather(out, piece, /*root=*/1, *group);
      cd::Work moved = std::move(w);
      moved.wait();
      moved.wait();                  // idempotent
      EXPECT_TRUE(w.is_completed()); // a moved-from handle is complete
      if (rank == 1) {
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(out.narrow(0, 5 * r, 5)
                          .to(at::kFloat)
                          .eq(r + 1)
                          .all()
                          .item<bool>());
        }
      }
    }
  });
}

TEST(Collectives, BadArgumentsNameTheProblem) {
  run_distributed(2, [](int rank, int) {
    auto group = cd::world_group();
    auto out = at::empty({10});
    auto wrong = at::empty({3});
    try {
      cd::all_gather(out, wrong, *group);
      ADD_FAILURE() << "expected an error";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("all_gather"), std::string::npos);
    }
    auto strided = at::empty({4, 4}).t();
    EXPECT_THROW(cd::all_reduce(strided, *group), c10::Error);
  });
}

TEST(Collectives, ShardRangeIsBalanced) {
  EXPECT_EQ(cd::shard_range(10, 3, 0), (std::pair<int64_t, int64_t>(0, 4)));
  EXPECT_EQ(cd::shard_range(10, 3, 1), (std::pair<int64_t, int64_t>(4, 7)));
  EXPECT_EQ(cd::shard_range(10, 3, 2), (std::pair<int64_t, int64_t>(7, 10)));
  EXPECT_EQ(cd::shard_range(2, 4, 3), (std::pair<int64_t, int64_t>(2, 2)));
}

// The harness re-runs a test in each child to reach the run_processes call
// it was spawned for. A child whose test returns without reaching it (the
// call skipped, a changed code path, an early return) must fail: it ran
// nothing. Here the children skip the call on purpose.
TEST(Harness, ChildThatNeverReachesItsInvocationFails) {
  if (std::getenv("COLOSSALAI_TEST_CHILD") != nullptr) {
    return;
  }
  auto results = colossalai::testing::run_processes(2, [](int, int) {});
  ASSERT_EQ(results.size(), 2u);
  for (const auto& r : results) {
    EXPECT_NE(r.exit_code, 0) << "rank " << r.rank << " passed silently";
    EXPECT_NE(r.output.find("never reached"), std::string::npos) << r.output;
  }
}

// Which path each operation takes, over Gloo's sockets: Gloo's own flat
// all-gather and bf16 sums where the linked LibTorch has them, the
// replacements where it does not, and the replacement reduce-scatter always
// (Gloo's own sends an all-reduce's bytes; NOTE [Gloo replacements]);
// shared memory where every rank is on this host. The results themselves
// are checked by the tests above on whichever path runs. Expected: 1.13 has
// neither; 2.15's Gloo declares both (its headers). Releases in between are
// found at run time and the path is printed.
TEST(Collectives, PathsSayWhatRan) {
  std::optional<cd::CollectivePath> expected;
  if (!COLOSSALAI_TORCH_AT_LEAST(2, 0)) {
    expected = cd::CollectivePath::kReplacement;
  } else if (COLOSSALAI_TORCH_AT_LEAST(2, 15)) {
    expected = cd::CollectivePath::kBackend;
  }
  colossalai::testing::MultiProcessOptions o;
  o.shm_collectives = false;
  run_distributed(
      2,
      [expected](int rank, int world) {
        auto check = [&](const char* op, const std::string& what) {
          const auto path = cd::collective_path(op);
          if (rank == 0) {
            std::cout << "[ path     ] " << what
                      << " over Gloo: " << cd::to_string(path) << std::endl;
          }
          EXPECT_NE(path, cd::CollectivePath::kSharedMemory) << what;
          EXPECT_NE(path, cd::CollectivePath::kNone) << what;
          if (expected) {
            EXPECT_EQ(path, *expected) << what << ": " << cd::to_string(path);
          }
        };
        auto group = cd::world_group();
        for (int64_t n : {8, 7}) { // even and uneven shards
          auto range = cd::shard_range(n, world, rank);
          auto out = at::empty({range.second - range.first});
          cd::reduce_scatter(out, input(rank, n, at::kFloat), *group).wait();
          EXPECT_EQ(
              cd::collective_path("reduce_scatter"),
              cd::CollectivePath::kReplacement)
              << "fp32 reduce_scatter n=" << n;
        }
        {
          // Max: Gloo's own reduce-scatter only sums (2.6 returns sums).
          auto out = at::empty({4});
          cd::reduce_scatter(
              out, input(rank, 8, at::kFloat), *group, cd::ReduceOp::kMax)
              .wait();
          EXPECT_EQ(
              cd::collective_path("reduce_scatter"),
              cd::CollectivePath::kReplacement);
        }
        auto shard = input(rank, 4, at::kFloat);
        auto full = at::empty({8});
        cd::all_gather(full, shard, *group).wait();
        check("all_gather", "fp32 all_gather");
        auto t = input(rank, 9, at::kBFloat16);
        cd::all_reduce(t, *group).wait();
        check("all_reduce", "bf16 all_reduce");
      },
      o);
  if (!shm_usable()) {
    return;
  }
  run_distributed(2, [](int rank, int world) {
    auto group = cd::world_group();
    auto out = at::empty({4});
    cd::reduce_scatter(out, input(rank, 8, at::kFloat), *group).wait();
    EXPECT_EQ(
        cd::collective_path("reduce_scatter"),
        cd::CollectivePath::kSharedMemory);
  });
  EXPECT_THROW(cd::collective_path("scatter"), c10::Error);
}

// Each group says which transport it took and why, the same on every
// member: shared memory on one host (within the budget), Gloo when shared
// memory is off or the budget is spent (the line on stderr says so), local
// for a group of one. COLOSSALAI_SHM_BUDGET_MB=12 on 2 ranks: the world's
// segment (8 MiB + a page) fits, a second group's shrinks to the ~4 MiB
// left, a third gets Gloo; every group's results are right.
TEST(Collectives, EachGroupSaysWhichTransportAndWhy) {
  if (!shm_usable()) {
    GTEST_SKIP() << "no memfd_create here";
  }
  auto sum_is_right = [](const cd::ProcessGroup& g, int world) {
    auto t = at::full({int64_t(3) << 20}, static_cast<double>(g.rank() + 1));
    cd::all_reduce(t, g).wait();
    EXPECT_TRUE(t.eq(world * (world + 1) / 2).all().item<bool>()) << g.name();
  };
  run_distributed(2, [&](int rank, int world) {
    auto g = cd::world_group();
    EXPECT_EQ(g->transport().name, "shared memory");
    EXPECT_NE(
        g->transport().reason.find("all 2 members run on this host"),
        std::string::npos)
        << g->transport().reason;
    EXPECT_GE(g->transport().segment_bytes, int64_t(8) << 20);
    auto alone = cd::new_group({rank}, "alone");
    EXPECT_EQ(alone->transport().name, "local");
    sum_is_right(*g, world);
  });
  colossalai::testing::MultiProcessOptions off;
  off.shm_collectives = false;
  run_distributed(
      2,
      [&](int, int world) {
        auto g = cd::world_group();
        EXPECT_EQ(g->transport().name, "gloo");
        EXPECT_NE(
            g->transport().reason.find("shm_collectives"), std::string::npos);
        EXPECT_EQ(g->transport().segment_bytes, 0);
        sum_is_right(*g, world);
      },
      off);
  colossalai::testing::MultiProcessOptions tight;
  tight.env[-1]["COLOSSALAI_SHM_BUDGET_MB"] = "12";
  auto results = colossalai::testing::run_processes(
      2,
      [&](int, int world) {
        auto first = cd::world_group();
        auto second = cd::new_group({0, 1}, "second");
        auto third = cd::new_group({0, 1}, "third");
        EXPECT_EQ(first->transport().name, "shared memory");
        EXPECT_EQ(second->transport().name, "shared memory");
        EXPECT_LT(second->transport().segment_bytes, int64_t(4) << 20);
        EXPECT_GE(second->transport().segment_bytes, int64_t(1) << 20);
        EXPECT_EQ(third->transport().name, "gloo");
        EXPECT_NE(
            third->transport().reason.find("budget is spent"),
            std::string::npos)
            << third->transport().reason;
        for (const auto* g : {first.get(), second.get(), third.get()}) {
          sum_is_right(*g, world);
        }
      },
      tight);
  if (!results.empty()) {
    for (const auto& r : results) {
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
    EXPECT_NE(
        results[0].output.find("colossalai: group 'third' [0,1]: gloo (the "
                               "shared-memory budget is spent"),
        std::string::npos)
        << results[0].output;
    EXPECT_EQ(results[1].output.find("group 'third'"), std::string::npos)
        << "one line per group, from its first member";
  }
}

// NOTE [One order per group]: a barrier completes only after every earlier
// collective of the group - those through the segment and those it runs on
// Gloo (gather, all-to-all, a bool reduction) - so their handles report
// completion without a wait; is_completed() turns true by itself for work
// through the segment. The same holds on Gloo alone (c10d's barrier).
TEST(Collectives, BarrierOrdersEarlierCollectivesOfTheGroup) {
  for (bool shm : {true, false}) {
    if (shm && !shm_usable()) {
      continue; // the Gloo half still runs
    }
    SCOPED_TRACE(shm ? "shared memory" : "Gloo alone");
    colossalai::testing::MultiProcessOptions o;
    o.shm_collectives = shm;
    run_distributed(
        3,
        [](int rank, int world) {
          auto g = cd::world_group();
          auto big = at::full({int64_t(4) << 20}, static_cast<double>(rank));
          auto w_big = cd::all_reduce(big, *g);
          auto piece = at::full({1000}, static_cast<double>(rank));
          auto gathered = at::empty({1000 * world});
          auto w_gather = cd::gather(gathered, piece, 0, *g);
          auto blocks = at::full({world * 10}, static_cast<double>(rank));
          auto swapped = at::empty({world * 10});
          auto w_a2a = cd::all_to_all(swapped, blocks, *g);
          cd::barrier(*g).wait();
          EXPECT_TRUE(w_big.is_completed());
          EXPECT_TRUE(w_gather.is_completed());
          EXPECT_TRUE(w_a2a.is_completed());
          w_big.wait();
          w_gather.wait();
          w_a2a.wait();
          EXPECT_TRUE(big.eq(world * (world - 1) / 2).all().item<bool>());
          for (int r = 0; r < world; ++r) {
            EXPECT_TRUE(swapped.narrow(0, 10 * r, 10).eq(r).all().item<bool>());
            if (rank == 0) {
              EXPECT_TRUE(
                  gathered.narrow(0, 1000 * r, 1000).eq(r).all().item<bool>());
            }
          }
          // Completion shows without wait().
          auto more = at::ones({int64_t(1) << 20});
          auto w = cd::all_reduce(more, *g);
          const auto deadline =
              std::chrono::steady_clock::now() + std::chrono::seconds(20);
          while (!w.is_completed() &&
                 std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          EXPECT_TRUE(w.is_completed());
          w.wait();
          EXPECT_TRUE(more.eq(world).all().item<bool>());
        },
        o);
  }
}

namespace {

const char* kSmallShm = "COLOSSALAI_TEST_SMALL_SHM";

} // namespace

// Under Docker's default /dev/shm of 64 MiB (a tmpfs mounted in a private
// mount namespace; needs root), every group of a 2 x 2 mesh and four more
// world groups - 96 MiB of segments in each process, 112 MiB on the host -
// still take shared memory, since segments are anonymous memory files that
// /dev/shm's size does not bound, and all their results are right.
TEST(Collectives, HybridMeshUnderDockersDefaultDevShm) {
  if (std::getenv(kSmallShm) == nullptr) {
    if (!shm_usable() || ::geteuid() != 0 ||
        std::system("unshare --mount --propagation private sh -c 'mount -t "
                    "tmpfs -o size=64m tmpfs /dev/shm' >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "needs memfd_create, root, unshare(1) and mount(8) for "
                      "a private /dev/shm";
    }
    const std::string self = std::filesystem::read_symlink("/proc/self/exe");
    const std::string cmd = std::string("unshare --mount --propagation ") +
        "private sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && " +
        kSmallShm + "=1 exec \"" + self +
        "\" --gtest_filter=Collectives.HybridMeshUnderDockersDefaultDevShm' " +
        "2>&1";
    FILE* p = ::popen(cmd.c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof(buf), p)) {
      out.append(buf, n);
    }
    const int status = ::pclose(p);
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
    std::cout << out;
    return;
  }
  struct statvfs fs {};
  ASSERT_EQ(::statvfs("/dev/shm", &fs), 0);
  ASSERT_EQ(fs.f_blocks * fs.f_frsize, uint64_t(64) << 20);
  // The default budget depends on the machine's free memory; this test
  // is about /dev/shm, so it states the budget.
  colossalai::testing::MultiProcessOptions o;
  o.env[-1]["COLOSSALAI_SHM_BUDGET_MB"] = "256";
  run_distributed(
      4,
      [](int rank, int world) {
        colossalai::cluster::ProcessGroupMesh mesh({2, 2});
        std::vector<cd::ProcessGroupPtr> groups = {
            cd::world_group(),
            mesh.get_group_along_axis(0),
            mesh.get_group_along_axis(1)};
        for (int i = 0; i < 4; ++i) {
          groups.push_back(
              cd::new_group({0, 1, 2, 3}, "extra" + std::to_string(i)));
        }
        int64_t mapped = 0;
        for (const auto& g : groups) {
          EXPECT_EQ(g->transport().name, "shared memory")
              << g->name() << ": " << g->transport().reason;
          mapped += g->transport().segment_bytes;
          auto t = at::full({int64_t(1) << 20}, static_cast<double>(rank + 1));
          cd::all_reduce(t, *g).wait();
          double want = 0;
          for (int r : g->ranks()) {
            want += r + 1;
          }
          EXPECT_TRUE(t.eq(want).all().item<bool>()) << g->name();
          auto shard = at::empty({(int64_t(1) << 20) / g->size()});
          cd::reduce_scatter(shard, t, *g).wait();
          EXPECT_TRUE(shard.eq(want * g->size()).all().item<bool>())
              << g->name();
        }
        EXPECT_GT(mapped, int64_t(64) << 20);
        for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
          ADD_FAILURE() << "in /dev/shm: " << e.path();
        }
      },
      o);
}

// all_to_all through the segment: blocks many slots long, uneven and of
// rows of 3 elements (rank r sends rank q (q + 1) * 100003 + 7 r rows of
// value 10 r + q), then splits that disagree between a sender and its
// receiver: every rank raises a DistributedError naming the pair, none
// waits for the others, and the group's next collective fails with it.
TEST(Collectives, SharedMemoryAllToAllManyRoundsAndMismatchedSplits) {
  if (!shm_usable()) {
    GTEST_SKIP() << "no memfd_create here";
  }
  run_distributed(3, [](int rank, int world) {
    auto g = cd::world_group();
    auto rows = [](int from, int to) {
      return int64_t(to + 1) * 100003 + 7 * from;
    };
    std::vector<int64_t> in_splits(world), out_splits(world);
    int64_t in_rows = 0, out_rows = 0;
    for (int q = 0; q < world; ++q) {
      in_splits[q] = rows(rank, q);
      out_splits[q] = rows(q, rank);
      in_rows += in_splits[q];
      out_rows += out_splits[q];
    }
    auto in = at::empty({in_rows, 3});
    int64_t at = 0;
    for (int q = 0; q < world; ++q) {
      in.narrow(0, at, in_splits[q]).fill_(10 * rank + q);
      at += in_splits[q];
    }
    auto out = at::full({out_rows, 3}, -1.0);
    cd::all_to_all(out, in, *g, out_splits, in_splits).wait();
    at = 0;
    for (int q = 0; q < world; ++q) {
      EXPECT_TRUE(
          out.narrow(0, at, out_splits[q]).eq(10 * q + rank).all().item<bool>())
          << "block from rank " << q;
      at += out_splits[q];
    }
    // Rank 1 expects one row too many from rank 0 (on a group of its own:
    // the error breaks the group for every later collective).
    auto broken = cd::new_group({0, 1, 2}, "broken");
    std::vector<int64_t> wrong = {2, 2, 2};
    auto small_in = at::zeros({6});
    auto small_out = at::zeros({rank == 1 ? 7 : 6});
    if (rank == 1) {
      wrong[0] = 3;
    }
    try {
      cd::all_to_all(small_out, small_in, *broken, wrong, {2, 2, 2}).wait();
      ADD_FAILURE() << "mismatched splits went through";
    } catch (const cd::DistributedError& e) {
      const std::string msg = e.what();
      EXPECT_NE(
          msg.find("group rank 0 sends 8 bytes to group rank 1, which expects "
                   "12"),
          std::string::npos)
          << msg;
    }
    EXPECT_THROW(cd::barrier(*broken).wait(), cd::DistributedError);
  });
}
