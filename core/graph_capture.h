// Device graphs: a training step's device work recorded once and replayed (CUDA graphs).
//
// Core knows no CUDA: a backend that can record registers a GraphBackend for its device
// type when it loads (core/cuda does). While a capture is under way on this thread,
// graph_capture_underway() is true, and code below train/ keeps to what a replay can repeat:
// no host reads of device values (kernels skip their host-side error checks, which would
// synchronise; values the host used to read stay on the device), and values that change
// from step to step come from device memory rather than kernel arguments.
#pragma once
#include <memory>

#include "tessera/core/device.h"

namespace tessera {

// True while this thread records a device graph.
bool graph_capture_underway();

// A recorded sequence of device work. Memory allocated while it was recorded stays reserved
// for it (its replays write there) until it is destroyed.
class DeviceGraph {
 public:
  virtual ~DeviceGraph() = default;
  // Runs the recorded work again, ordered after the work queued so far on the device's
  // current stream and before what is queued there next.
  virtual void replay() = 0;
};

class GraphBackend {
 public:
  virtual ~GraphBackend() = default;
  // Starts recording the work this thread queues on `device` (it goes to a capture stream
  // made current until the capture ends). Allocations come from a pool private to the graph.
  virtual void begin_capture(Device device) = 0;
  // Ends the recording and returns the graph; throws (having ended the capture and released
  // its pool) when something in it could not be recorded.
  virtual std::unique_ptr<DeviceGraph> end_capture(Device device) = 0;
  // Ends a capture that failed part-way (after an exception), dropping what was recorded.
  virtual void abort_capture(Device device) = 0;
};

void register_graph_backend(DeviceType type, GraphBackend* backend);
// The backend for `type`, or null when that device type cannot record graphs.
GraphBackend* graph_backend(DeviceType type);

namespace detail {
// Set by a GraphBackend around a capture (thread-local).
void set_graph_capture_underway(bool on);
}  // namespace detail

}  // namespace tessera
