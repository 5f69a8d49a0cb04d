#include "tessera/core/backend_library.h"

#include <dlfcn.h>

#include <filesystem>
#include <map>
#include <mutex>

namespace tessera {

namespace {

struct LoadResult {
  bool loaded = false;
  std::string why_not;
};

// The folder holding the shared object this function was linked into (libtessera.so).
std::filesystem::path own_folder() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&own_folder), &info) == 0 || info.dli_fname == nullptr)
    return {};
  return std::filesystem::path(info.dli_fname).parent_path();
}

LoadResult load(const std::string& name) {
  const std::string file = TESSERA_BACKEND_LIBRARY_PREFIX + name + TESSERA_BACKEND_LIBRARY_SUFFIX;
  // RTLD_GLOBAL: the backend's own dependencies (Open MPI's components, for one) look their
  // symbols up in the global scope.
  const int flags = RTLD_NOW | RTLD_GLOBAL;
  std::string errors;
  const std::filesystem::path beside = own_folder() / file;
  if (std::filesystem::exists(beside)) {
    if (dlopen(beside.c_str(), flags) != nullptr) return {true, ""};
    errors = dlerror();
  }
  if (dlopen(file.c_str(), flags) != nullptr) return {true, ""};
  const char* error = dlerror();
  if (!errors.empty()) errors += "; ";
  errors += error ? error : file + ": unknown dlopen error";
  return {false, "cannot load the '" + name + "' backend (" + file + ", looked for beside " +
                     (own_folder().empty() ? std::string("libtessera.so") : own_folder().string()) +
                     " and on the library path): " + errors +
                     ". Was Tessera built with it (TESSERA_CUDA / TESSERA_MPI) and installed "
                     "with its dependencies?"};
}

}  // namespace

bool load_backend_library(const std::string& name, std::string* why_not) {
  // Recursive: a backend's start-up code may ask whether its own device is available.
  static std::recursive_mutex mutex;
  static std::map<std::string, LoadResult> results;
  std::lock_guard<std::recursive_mutex> lock(mutex);
  auto it = results.find(name);
  if (it == results.end()) it = results.emplace(name, load(name)).first;
  if (why_not != nullptr) *why_not = it->second.why_not;
  return it->second.loaded;
}

}  // namespace tessera
