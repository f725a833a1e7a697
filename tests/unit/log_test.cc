// The log's two forms: its own time stamp on a file or terminal, and under journald (stderr is
// the stream JOURNAL_STREAM names) a syslog priority per line and no time stamp.
#include "common/log.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <regex>
#include <string>

namespace vrdma {
namespace {

/// Points stderr at a temporary file for the test's life, and back.
class StderrToFile {
 public:
  StderrToFile() {
    std::fflush(stderr);
    file_ = std::tmpfile();
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(::fileno(file_), STDERR_FILENO);
  }
  ~StderrToFile() {
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    std::fclose(file_);
    ::unsetenv("JOURNAL_STREAM");
    log::recheck_stderr();
  }
  /// "DEV:INO" of the file, as systemd sets JOURNAL_STREAM for the journal's stream.
  std::string dev_ino() const {
    struct stat st {};
    ::fstat(::fileno(file_), &st);
    return std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
  }
  std::string text() const {
    std::string out(4096, '\0');
    const ssize_t n = ::pread(::fileno(file_), out.data(), out.size(), 0);
    out.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return out;
  }

 private:
  FILE* file_ = nullptr;
  int saved_ = -1;
};

TEST(Log, JournalStreamMatchesOnlyItsOwnFile) {
  StderrToFile f;
  EXPECT_TRUE(log::is_journal_stream(f.dev_ino().c_str(), STDERR_FILENO));
  EXPECT_FALSE(log::is_journal_stream(nullptr, STDERR_FILENO));
  EXPECT_FALSE(log::is_journal_stream("", STDERR_FILENO));
  EXPECT_FALSE(log::is_journal_stream((f.dev_ino() + "x").c_str(), STDERR_FILENO));
  EXPECT_FALSE(log::is_journal_stream("1:2", STDERR_FILENO));  // inherited, stderr elsewhere
}

TEST(Log, UnderJournaldLinesCarryPrioritiesAndNoTime) {
  StderrToFile f;
  ::setenv("JOURNAL_STREAM", f.dev_ino().c_str(), 1);
  log::recheck_stderr();
  log::write(log::Level::kError, "e");
  log::write(log::Level::kWarn, "w");
  log::write(log::Level::kInfo, "i");
  log::write(log::Level::kDebug, "d");
  const std::string pid = std::to_string(::getpid());
  EXPECT_EQ(f.text(), "<3>vrdma[" + pid + "] error: e\n<4>vrdma[" + pid + "] warn: w\n<6>vrdma[" +
                          pid + "] info: i\n<7>vrdma[" + pid + "] debug: d\n");
}

TEST(Log, ElsewhereLinesCarryTheirTime) {
  StderrToFile f;
  ::setenv("JOURNAL_STREAM", "1:2", 1);  // another file's: stderr was redirected
  log::recheck_stderr();
  log::write(log::Level::kWarn, "w");
  EXPECT_TRUE(std::regex_match(f.text(),
                               std::regex("[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6} vrdma\\[[0-9]+\\] "
                                          "warn: w\n")))
      << f.text();
}

}  // namespace
}  // namespace vrdma
