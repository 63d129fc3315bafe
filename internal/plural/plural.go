// Package plural agrees a count with its noun in the tools' messages:
// "1 event", "2 events", never "1 events".
package plural

import "fmt"

// Of is n and the form of the noun that agrees with it: one when n is 1,
// many otherwise ("0 events").
func Of[N ~int | ~int64](n N, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
