// The caller's spin for a command's answer (common/answer_spin.h): bounded, it follows the
// answers' times, stops after answers that miss it and tries again now and then.
#include "common/answer_spin.h"

#include <gtest/gtest.h>
#include <sys/socket.h>

namespace vrdma {
namespace {

TEST(AnswerSpin, FollowsTheAnswersAndStopsWhenTheyMissIt) {
  AnswerSpin s;
  EXPECT_EQ(s.budget_ns(), AnswerSpin::kMaxNs);  // a first call spins the most
  for (int i = 0; i < 20; ++i) s.note(s.budget_ns(), 3'000);
  EXPECT_EQ(s.budget_ns(), 12'000u);  // four times the usual answer's time
  for (int i = 0; i < 20; ++i) s.note(s.budget_ns(), 100);
  EXPECT_EQ(s.budget_ns(), AnswerSpin::kMinNs);
  // Answers that come after the spin: it halves, down to none.
  s.note(AnswerSpin::kMinNs, 1'000'000);
  EXPECT_EQ(s.budget_ns(), 0u);
}

TEST(AnswerSpin, ProbesAgainWhileNotSpinning) {
  AnswerSpin s;
  for (int i = 0; i < 8; ++i) s.note(s.budget_ns(), 10'000'000);  // a slow backend
  int spun = 0, probes = 0;
  for (uint32_t i = 0; i < 4 * AnswerSpin::kProbeEvery; ++i) {
    const uint64_t b = s.budget_ns();
    spun += b != 0;
    probes += b == AnswerSpin::kMaxNs;
    s.note(b, 10'000'000);
  }
  EXPECT_EQ(spun, 4);
  EXPECT_EQ(probes, 4);
  // A probe the answer beats: spinning again.
  for (uint32_t i = 0; i < AnswerSpin::kProbeEvery; ++i) {
    const uint64_t b = s.budget_ns();
    s.note(b, 5'000);
  }
  EXPECT_EQ(s.budget_ns(), 20'000u);
}

TEST(AnswerSpin, SpinRecvIsBoundedAndTakesWhatIsThere) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  std::vector<uint8_t> buf;
  std::vector<UniqueFd> fds;
  const uint64_t t0 = mono_ns();
  EXPECT_EQ(spin_recv(a.get(), buf, 64, fds, 20'000).err(), EAGAIN);
  const uint64_t took = mono_ns() - t0;
  EXPECT_GE(took, 20'000u);
  EXPECT_LT(took, 1'000'000'000u);  // bounded (generous: a loaded machine may preempt it)
  const uint8_t msg[3] = {1, 2, 3};
  ASSERT_TRUE(send_msg(b.get(), msg).is_ok());
  ASSERT_TRUE(spin_recv(a.get(), buf, 64, fds, 20'000).is_ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(msg, msg + 3));
}

}  // namespace
}  // namespace vrdma
