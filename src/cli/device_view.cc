// The view of device_view.h: one tmpfs over /dev/infiniband holding uverbs0, one over /sys/class
// holding vrdma0's files beside bind mounts of every class the host has (so /sys/class/net and
// the rest read as before). Both live in the program's own mount namespace, slave to the host's.
#include "cli/device_view.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/identity.h"
#include "common/paths.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace vrdma::cli {
namespace {

constexpr const char* kDevDir = "/dev/infiniband";
constexpr const char* kNode = "/dev/infiniband/uverbs0";
constexpr const char* kClassDir = "/sys/class";
/// What the kernel's ib_uverbs numbers its first device: major 231, minors from 192.
constexpr unsigned kUverbsMajor = 231;
constexpr unsigned kUverbsMinor = 192;

std::string guid_text(uint64_t g) {
  return fmt::format("{:04x}:{:04x}:{:04x}:{:04x}", (g >> 48) & 0xffff, (g >> 32) & 0xffff,
                     (g >> 16) & 0xffff, g & 0xffff);
}

/// As the kernel prints a GID in sysfs (%pI6): eight groups of four hex digits.
std::string gid_text(const std::array<uint8_t, 16>& g) {
  std::string s;
  for (size_t i = 0; i < g.size(); i += 2) {
    s += fmt::format("{}{:02x}{:02x}", i ? ":" : "", g[i], g[i + 1]);
  }
  return s;
}

Status sys_error(const std::string& what) {
  const int e = errno;
  return error(e, fmt::format("{}: {}", what, std::strerror(e)));
}

/// Writes `text` and a newline to `rel` under the directory `root`, making its parents.
Status write_file(int root, const std::string& rel, const std::string& text) {
  for (size_t i = rel.find('/'); i != std::string::npos; i = rel.find('/', i + 1)) {
    if (::mkdirat(root, rel.substr(0, i).c_str(), 0755) != 0 && errno != EEXIST)
      return sys_error("mkdir " + rel.substr(0, i));
  }
  const UniqueFd fd(
      ::openat(root, rel.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444));
  if (!fd.valid()) return sys_error("create " + rel);
  const std::string line = text + "\n";
  if (::write(fd.get(), line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    return sys_error("write " + rel);
  return Status::ok();
}

Status write_proc(const char* path, const std::string& text) {
  const UniqueFd fd(::open(path, O_WRONLY | O_CLOEXEC));
  if (!fd.valid() ||
      ::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    return sys_error(fmt::format("write {} to {}", text, path));
  return Status::ok();
}

std::string read_line(const std::string& path) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  char buf[128];
  const ssize_t n = fd.valid() ? ::read(fd.get(), buf, sizeof(buf)) : -1;
  if (n <= 0) return {};
  std::string s(buf, static_cast<size_t>(n));
  if (s.back() == '\n') s.pop_back();
  return s;
}

/// True when uverbs0 is there for UCX's check (a character device this user may read and write,
/// whatever it is) and vrdma0's sysfs says this guest's GID: set up host-wide, or by an outer
/// `vrdma run` for the same guest.
bool already_visible(const std::string& guest) {
  struct stat st {};
  if (::stat(kNode, &st) != 0 || !S_ISCHR(st.st_mode) || ::access(kNode, R_OK | W_OK) != 0)
    return false;
  return read_line(std::string(kClassDir) + "/infiniband/vrdma0/ports/1/gids/0") ==
         gid_text(gid_of(guest));
}

/// A tmpfs on /dev/infiniband with uverbs0: the real node's numbers where mknod is allowed,
/// else /dev/null bind-mounted on the name (a user namespace may not make device nodes; UCX
/// only checks for a character device it may read and write, and never opens it).
Status mount_dev() {
  if (::mount("vrdma", kDevDir, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=16k") != 0)
    return sys_error(fmt::format("mount a tmpfs on {}", kDevDir));
  if (::mknod(kNode, S_IFCHR | 0666, makedev(kUverbsMajor, kUverbsMinor)) == 0) return Status::ok();
  const UniqueFd f(::open(kNode, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
  if (!f.valid() || ::mount("/dev/null", kNode, nullptr, MS_BIND, nullptr) != 0) {
    Status st = sys_error(fmt::format("bind /dev/null on {}", kNode));
    ::umount2(kDevDir, MNT_DETACH);
    return st;
  }
  return Status::ok();
}

/// Fills the tmpfs now on /sys/class: a bind mount of each class `orig` (the directory it
/// covers) holds, then the view's files; read-only once done.
Status fill_class(int orig, const std::vector<std::string>& classes, const std::string& guest) {
  const UniqueFd root(::open(kClassDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root.valid()) return sys_error("open the new /sys/class");
  for (const auto& c : classes) {
    const std::string src = fmt::format("/proc/self/fd/{}/{}", orig, c);
    const std::string dst = fmt::format("{}/{}", kClassDir, c);
    if (::mkdirat(root.get(), c.c_str(), 0755) != 0 ||
        ::mount(src.c_str(), dst.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0)
      return sys_error("bind " + dst);
  }
  for (const auto& [rel, text] : sysfs_view_files(guest))
    RETURN_IF_ERROR(write_file(root.get(), rel, text));
  if (::mount(nullptr, kClassDir, nullptr,
              MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC | MS_NODEV, nullptr) != 0)
    return sys_error("make the /sys/class view read-only");
  return Status::ok();
}

Status mount_class(const std::string& guest) {
  const UniqueFd orig(::open(kClassDir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!orig.valid()) return sys_error(fmt::format("open {}", kClassDir));
  std::vector<std::string> classes;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(kClassDir, ec)) {
    const std::string name = e.path().filename().string();
    // Ours replace the host's, whose devices the program could not use through vrdma anyway.
    if (name != "infiniband" && name != "infiniband_verbs") classes.push_back(name);
  }
  if (ec) return error(ec.value(), fmt::format("list {}: {}", kClassDir, ec.message()));
  if (::mount("vrdma", kClassDir, "tmpfs", MS_NOSUID | MS_NOEXEC | MS_NODEV, "mode=0755,size=1m") !=
      0)
    return sys_error(fmt::format("mount a tmpfs on {}", kClassDir));
  Status st = fill_class(orig.get(), classes, guest);
  if (!st) ::umount2(kClassDir, MNT_DETACH);
  return st;
}

/// Both mounts, in the caller's mount namespace. On failure neither is left.
Status mount_view(const std::string& guest) {
  // The view's modes are the kernel's, whatever the caller's umask; restored before the exec.
  const mode_t old_umask = ::umask(0);
  Status st = mount_dev();
  if (st) {
    st = mount_class(guest);
    if (!st) ::umount2(kDevDir, MNT_DETACH);
  }
  ::umask(old_umask);
  return st;
}

/// Both mounts, in the mount namespace this process already has of its own.
Status build_view(const std::string& guest) {
  // Slave, not private: the host's later mounts still show, ours never reach it.
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0)
    return sys_error("make the mounts slave to the host's");
  return mount_view(guest);
}

/// A user namespace (with a mount namespace) in which this process keeps its uid and gid.
Status enter_user_namespace() {
  const uid_t uid = ::geteuid();
  const gid_t gid = ::getegid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
    return sys_error("unprivileged user namespaces: unshare(CLONE_NEWUSER|CLONE_NEWNS)");
  RETURN_IF_ERROR(write_proc("/proc/self/setgroups", "deny"));
  RETURN_IF_ERROR(write_proc("/proc/self/uid_map", fmt::format("{0} {0} 1", uid)));
  return write_proc("/proc/self/gid_map", fmt::format("{0} {0} 1", gid));
}

/// Tries enter_user_namespace and build_view in a child first: a process never leaves a user
/// namespace, and one whose mapping or mounts the kernel refuses (a sysctl, AppArmor's
/// restrict_unprivileged_userns) would run the program as the overflow uid or without caps.
Status try_user_namespace(const std::string& guest) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) return sys_error("pipe");
  const UniqueFd rd(p[0]);
  UniqueFd wr(p[1]);
  const pid_t pid = ::fork();
  if (pid < 0) return sys_error("fork");
  if (pid == 0) {
    Status st = enter_user_namespace();
    if (st) st = build_view(guest);
    if (!st) {
      ssize_t n = ::write(wr.get(), st.message().data(), st.message().size());
      (void)n;
    }
    ::_exit(st ? 0 : 1);
  }
  wr.reset();
  std::string why;
  char buf[512];
  for (ssize_t n; (n = ::read(rd.get(), buf, sizeof(buf))) != 0;) {
    if (n > 0) why.append(buf, static_cast<size_t>(n));
    if (n < 0 && errno != EINTR) break;
  }
  int wstatus = 0;
  while (::waitpid(pid, &wstatus, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return Status::ok();
  return error(EPERM, why.empty() ? "a user namespace failed" : why);
}

/// Whether the topmost mount on `dir` in this mount namespace is a view of ours (a tmpfs named
/// "vrdma"), from /proc/self/mountinfo: "ID PARENT MAJ:MIN ROOT MOUNTPOINT ... - FSTYPE SOURCE".
bool view_mounted_at(const std::string& dir) {
  std::ifstream in("/proc/self/mountinfo");
  bool ours = false;
  for (std::string line; std::getline(in, line);) {
    std::istringstream f(line);
    std::string id, parent, dev, root, point, word;
    f >> id >> parent >> dev >> root >> point;
    if (point != dir) continue;
    while (f >> word && word != "-") {
    }
    std::string fstype, source;
    f >> fstype >> source;
    ours = fstype == "tmpfs" && source == "vrdma";  // a later line is a mount on top
  }
  return ours;
}

/// The names in `dir` (none when it is missing), comma-separated.
std::string entries_of(const std::string& dir) {
  std::string names;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    names += (names.empty() ? "" : ", ") + e.path().filename().string();
  return names;
}

/// The state kHostViewState holds; ENOENT when there is none.
Result<nlohmann::json> read_state() {
  std::ifstream in(kHostViewState);
  if (!in) return error(ENOENT, fmt::format("no {}", kHostViewState));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("guest"))
    return error(EINVAL, fmt::format("{} is not what `vrdma setup` writes: look at it, then "
                                     "remove it and what it names by hand",
                                     kHostViewState));
  return j;
}

/// Writes `state` to kHostViewState (whole or not at all), making its directory if missing.
Status write_state(nlohmann::json& state) {
  const std::string dir = std::filesystem::path(kHostViewState).parent_path().string();
  const bool made = ::mkdir(dir.c_str(), 0755) == 0;
  if (!made && errno != EEXIST) return sys_error("mkdir " + dir);
  state["made_state_dir"] = made || state.value("made_state_dir", false);
  const std::string tmp = std::string(kHostViewState) + ".tmp";
  const std::string text = state.dump(2) + "\n";
  const UniqueFd fd(
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd.valid() ||
      ::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()) ||
      ::fsync(fd.get()) != 0 || ::rename(tmp.c_str(), kHostViewState) != 0) {
    Status st = sys_error("write " + std::string(kHostViewState));
    ::unlink(tmp.c_str());
    if (made) ::rmdir(dir.c_str());
    return st;
  }
  return Status::ok();
}

/// What stands on the uverbs0 name: the kernel's numbers, or /dev/null bound on it.
std::string node_kind() {
  struct stat st {};
  if (::stat(kNode, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == kUverbsMajor &&
      minor(st.st_rdev) == kUverbsMinor)
    return fmt::format("character device {}:{}", kUverbsMajor, kUverbsMinor);
  return "/dev/null bound on it";
}

}  // namespace

std::vector<std::pair<std::string, std::string>> sysfs_view_files(std::string_view guest) {
  const std::string guid = guid_text(port_guid_of(guest));
  const std::string dev = "infiniband/vrdma0/";
  const std::string port = dev + "ports/1/";
  // As src/verbs/context.cc answers ibv_query_device and ibv_query_port, in the kernel's text.
  return {
      {dev + "node_type", "1: CA"},
      {dev + "node_guid", guid},
      {dev + "sys_image_guid", guid},
      {dev + "fw_ver", "0.1.0"},
      {dev + "hca_type", "vrdma"},
      {dev + "board_id", "vrdma"},
      {dev + "node_desc", "vrdma0"},
      {port + "state", "4: ACTIVE"},
      {port + "phys_state", "5: LinkUp"},
      // The LID the name hashes to: the backend gives another only when a guest of another
      // name already holds it.
      {port + "lid", fmt::format("0x{:x}", lid_of_name(guest))},
      {port + "sm_lid", "0x1"},
      {port + "sm_sl", "0"},
      {port + "lid_mask_count", "0"},
      {port + "cap_mask", "0x00000000"},
      {port + "rate", "100 Gb/sec (4X EDR)"},
      {port + "link_layer", "InfiniBand"},
      {port + "gids/0", gid_text(gid_of(guest))},
      {port + "gid_attrs/types/0", "IB/RoCE v1"},
      {port + "pkeys/0", "0xffff"},
      {"infiniband_verbs/abi_version", "6"},
      {"infiniband_verbs/uverbs0/ibdev", "vrdma0"},
      {"infiniband_verbs/uverbs0/abi_version", "1"},
      {"infiniband_verbs/uverbs0/dev", fmt::format("{}:{}", kUverbsMajor, kUverbsMinor)},
  };
}

std::string provide_device_view(const std::string& guest) {
  if (already_visible(guest)) return {};
  if (::geteuid() == 0) {
    // The one change on the host: the mount point, an empty directory as udev would make it.
    if (::mkdir(kDevDir, 0755) != 0 && errno != EEXIST)
      return sys_error(fmt::format("mkdir {}", kDevDir)).message();
    if (::unshare(CLONE_NEWNS) == 0) {
      Status st = build_view(guest);
      return st ? std::string() : st.message();
    }
    // Root without CAP_SYS_ADMIN (a container): a user namespace may still be allowed.
  }
  struct stat st {};
  if (::stat(kDevDir, &st) != 0 || !S_ISDIR(st.st_mode))
    return fmt::format("no directory {} to mount on (root can make it: mkdir {})", kDevDir,
                       kDevDir);
  // The library checks that the socket's directory is the user's or root's; in a user namespace
  // that maps only the user, root's shows as the overflow uid and the library would refuse it.
  const std::string dir = std::filesystem::path(socket_path()).parent_path().string();
  if (::stat(dir.c_str(), &st) == 0 && st.st_uid != ::geteuid())
    return fmt::format(
        "the backend's directory {} belongs to uid {}, which a user namespace "
        "cannot map",
        dir, st.st_uid);
  if (Status t = try_user_namespace(guest); !t) return t.message();
  Status s = enter_user_namespace();
  if (s) s = build_view(guest);
  return s ? std::string() : s.message();
}

}  // namespace vrdma::cli

namespace vrdma::cli {

Result<nlohmann::json> setup_host_view(const std::string& guest) {
  if (::geteuid() != 0)
    return error(EPERM,
                 "needs root (it mounts on the host's /sys/class and /dev/infiniband); as any "
                 "user, `vrdma run` shows the view to the program it starts");
  RETURN_IF_ERROR(check_guest_name(guest));
  // A record whose mounts are gone (unmounted by hand) is set up again, keeping what it says
  // setup made, so that --remove still takes that away.
  bool made_before = false, made_state_before = false, recorded = false;
  if (auto prev = read_state(); prev) {
    recorded = true;
    if (view_mounted_at(kClassDir) && view_mounted_at(kDevDir)) {
      (*prev)["already"] = true;
      return prev;
    }
    for (const char* dir : {kClassDir, kDevDir})  // half of it: start over
      if (view_mounted_at(dir)) ::umount2(dir, MNT_DETACH);
    made_before = prev->value("made_dev_dir", false);
    made_state_before = prev->value("made_state_dir", false);
  } else if (prev.err() != ENOENT) {
    return prev.status();
  }
  if (!recorded && (view_mounted_at(kClassDir) || view_mounted_at(kDevDir)))
    return error(EEXIST, fmt::format("a vrdma view is mounted on {} or {} but {} is missing "
                                     "(is this the mount namespace of a `vrdma run`?)",
                                     kClassDir, kDevDir, kHostViewState));
  if (const std::string devs = entries_of("/sys/class/infiniband"); !devs.empty())
    return error(EEXIST, fmt::format("a kernel RDMA driver is loaded (/sys/class/infiniband: {}): "
                                     "setup is for hosts without one, whose devices it would hide",
                                     devs));
  if (const std::string nodes = entries_of(kDevDir); !nodes.empty())
    return error(EEXIST, fmt::format("{} is not empty ({}): a kernel RDMA driver's nodes, which "
                                     "setup would hide",
                                     kDevDir, nodes));
  const bool made_dir = ::mkdir(kDevDir, 0755) == 0;
  if (!made_dir && errno != EEXIST) return sys_error(fmt::format("mkdir {}", kDevDir));
  const bool made_any_dir = made_dir || made_before;
  nlohmann::json state = {
      {"guest", guest},
      {"lid", lid_of_name(guest)},
      {"gid", gid_text(gid_of(guest))},
      {"node", kNode},
      {"sysfs", fmt::format("{}/infiniband/vrdma0", kClassDir)},
      {"mounts", {kDevDir, kClassDir}},
      {"made_dev_dir", made_any_dir},
      {"since_s", static_cast<int64_t>(::time(nullptr))},
  };
  Status st = mount_view(guest);
  if (st) {
    state["node_kind"] = node_kind();
    state["made_state_dir"] = made_state_before;
    st = write_state(state);
    if (!st) {
      ::umount2(kClassDir, MNT_DETACH);
      ::umount2(kDevDir, MNT_DETACH);
    }
  }
  if (!st) {
    if (made_dir) ::rmdir(kDevDir);
    return st;
  }
  state["already"] = false;
  return state;
}

Result<nlohmann::json> remove_host_view() {
  if (::geteuid() != 0) return error(EPERM, "needs root (it unmounts what `vrdma setup` mounted)");
  auto state = read_state();
  if (!state) {
    if (state.err() != ENOENT) return state.status();
    return nlohmann::json{{"removed", false}, {"undone", nlohmann::json::array()}};
  }
  nlohmann::json undone = nlohmann::json::array();
  // The sysfs view first (its bind mounts go with it), then the node's tmpfs; only a view of
  // ours on top is unmounted, never what someone mounted over it since.
  for (const char* dir : {kClassDir, kDevDir}) {
    if (!view_mounted_at(dir)) continue;
    if (::umount2(dir, MNT_DETACH) != 0) return sys_error(fmt::format("umount {}", dir));
    undone.push_back(fmt::format("unmounted the view on {}", dir));
  }
  if (state->value("made_dev_dir", false)) {
    if (::rmdir(kDevDir) == 0)
      undone.push_back(fmt::format("removed {}", kDevDir));
    else
      undone.push_back(fmt::format("left {}: {}", kDevDir, std::strerror(errno)));
  }
  if (::unlink(kHostViewState) != 0 && errno != ENOENT)
    return sys_error(fmt::format("remove {}", kHostViewState));
  undone.push_back(fmt::format("removed {}", kHostViewState));
  // The directory only when setup made it and nothing (a backend's socket) came since.
  if (state->value("made_state_dir", false) &&
      ::rmdir(std::filesystem::path(kHostViewState).parent_path().c_str()) == 0)
    undone.push_back(
        fmt::format("removed {}", std::filesystem::path(kHostViewState).parent_path().string()));
  (*state)["removed"] = true;
  (*state)["undone"] = undone;
  return state;
}

}  // namespace vrdma::cli
