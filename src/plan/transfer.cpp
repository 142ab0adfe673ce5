// The price of sending saved tensors away, as measured steps set it
// (remat/plan/transfer.h).
#include "remat/plan/transfer.h"

#include <algorithm>
#include <string>

#include "remat/plan/error.h"

namespace remat::plan {

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
