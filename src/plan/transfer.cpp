// The price of sending saved tensors away, as measured steps set it
// (remat/plan/transfer.h).
#include "remat/plan/transfer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "remat/plan/error.h"

namespace remat::plan {

namespace {

/** One phase's wait (writes over the forward, reads over the backward). */
double phase_wait_ms(double phase_ms, double wait_ms, double busy_ms, int64_t bytes, int64_t room_bytes,
                     const char* what) {
  if (!std::isfinite(phase_ms) || !std::isfinite(wait_ms) || !std::isfinite(busy_ms) || phase_ms < 0 || wait_ms < 0 ||
      busy_ms < 0 || bytes < 0 || wait_ms > phase_ms) {
    throw Error(std::string("[remat::plan] transfer_wait_ms: the ") + what + " figures (phase " +
                std::to_string(phase_ms) + " ms, waited " + std::to_string(wait_ms) + " ms, busy " +
                std::to_string(busy_ms) + " ms, " + std::to_string(bytes) +
                " bytes) are not a measurement; give finite figures >= 0 with the wait within the phase");
  }
  if (bytes == 0) return wait_ms;
  const double compute_ms = phase_ms - wait_ms;
  const double overlapped = std::clamp(busy_ms - compute_ms, 0.0, wait_ms);  // with room for every byte
  const double share =
      std::min(1.0, static_cast<double>(std::max<int64_t>(room_bytes, 0)) / static_cast<double>(bytes));
  return wait_ms + (overlapped - wait_ms) * share;
}

}  // namespace

double transfer_wait_ms(const TransferRun& r, int64_t cap_bytes) {
  if (r.largest_bytes < 0) {
    throw Error("[remat::plan] transfer_wait_ms: largest_bytes is " + std::to_string(r.largest_bytes) +
                "; give the largest tensor the call sends, >= 0");
  }
  // The run already held one tensor in flight: only the room beyond it runs more beside the compute.
  const int64_t room = cap_bytes - r.largest_bytes;
  return phase_wait_ms(r.forward_ms, r.write_wait_ms, r.write_ms, r.written_bytes, room, "write") +
         phase_wait_ms(r.backward_ms, r.read_wait_ms, r.read_ms, r.read_bytes, room, "read");
}

TransferPrice::TransferPrice(int slow_steps_to_charge) : needed_(slow_steps_to_charge) {
  if (slow_steps_to_charge < 1) {
    throw Error("[remat::plan] TransferPrice: slow_steps_to_charge is " + std::to_string(slow_steps_to_charge) +
                "; give 1 or more (the steps in a row over the prediction before a charge)");
  }
}

double TransferPrice::observe(double measured_ms, double predicted_ms, double sent, double surcharge_ms_per_byte) {
  const bool slow = sent > 0 && measured_ms > 1.10 * predicted_ms;
  const bool fast = sent > 0 && surcharge_ms_per_byte > 0 && measured_ms < 0.90 * predicted_ms;
  slow_ = slow ? slow_ + 1 : 0;
  fast_ = fast ? fast_ + 1 : 0;
  if (slow && slow_ >= needed_) {
    slow_ = 0;
    charged_sent_ = sent;
    return (measured_ms - predicted_ms) / sent;
  }
  if (fast && fast_ >= 2) {
    fast_ = 0;
    return std::max((measured_ms - predicted_ms) / std::max(sent, charged_sent_), -surcharge_ms_per_byte);
  }
  return 0;
}

void TransferPrice::restart() { slow_ = fast_ = 0; }

void TransferPrice::reset() {
  restart();
  charged_sent_ = 0;
}

}  // namespace remat::plan
